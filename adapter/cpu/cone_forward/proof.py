"""The proof's harness: H (a prefix hit at F) against R (cone's replay from s = F - N), row for
row, in two worlds (world.py), and the negative controls. The document is prefilled once and
snapshot; each case loads it into both worlds (the package docstring has the layout). Cone is
installed by the production installer, so its hooks wrap the backend's own methods. Tests and
benches only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Callable

import torch

from adapter.cpu.cone_forward.model import CONTEXT, DIM, PAGE, RATIOS, WINDOW, Stack
from adapter.cpu.cone_forward.world import World, request_view

DOC = 2560                 # document length (10 pages): c4 top-k is selective past 2048
DOC_CHUNK = 512
DECODE_STEPS = 4
NOISE_SEED = 99
NEIGHBOR_SALT = 100_003


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    s: int
    F: int
    L: int
    chunk: int               # prefill chunk (first pass of R = [s, s + chunk))
    note: str = ""
    neighbor: int = 0        # a fresh prompt of this many tokens ahead of it in the first pass

    @property
    def N(self) -> int:
        return self.F - self.s


# Production shapes: F = swa_branching_seqlen is page aligned (the engine's walk aligns it), s =
# F - N with N a multiple of 256, so s, F and [s, F) are whole pages and every c4 / c128 group
# lies wholly inside [0, s), [s, F) or [F, L). The harness stack has 3 SWA-reading layers, so
# rows >= F are exact only when N covers its cone (N >= 3 * 127): N >= 512 here.
CASES = (
    Case("N=chunk=512 L-F=1", s=1536, F=2048, L=2049, chunk=512,
         note="the first pass is exactly the replay; the new row in a second pass"),
    Case("N=512<chunk=640 L-F=300", s=1792, F=2304, L=2604, chunk=640,
         note="replay + 128 new rows in the first pass, 172 in a second; L-F > a page"),
    Case("N=chunk=512 F=2560 L-F=257", s=2048, F=2560, L=2817, chunk=512,
         note="c4 top-k selective for every replay row and row >= F; L-F > a page"),
    Case("N=512<chunk=640 s=0 L-F=1", s=0, F=512, L=513, chunk=640,
         note="replay from position 0 (no resident prefix); one pass"),
    Case("N=512<chunk=640 beside a prompt", s=256, F=768, L=832, chunk=640, neighbor=96,
         note="a 96-token fresh prompt ahead of the replay in the first pass: its rows compared "
              "too; cone's masks and floors land on the replaying request's rows only"),
)
NOT_IN_PRODUCTION = ("F or s off a page boundary, and [s, F) ending inside a c4 / c128 group: "
                     "the engine reports F (swa_branching_seqlen) page aligned and cone makes s "
                     "= F - N with N a multiple of 256, so [s, F) is always whole 256-token pages "
                     "and every group boundary (4, 128) falls on them")



def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs()
    d = torch.where(torch.isnan(a) | torch.isnan(b),
                    torch.where(torch.isnan(a) & torch.isnan(b), 0.0, float("inf")), d)
    return float(d.max())


@dataclasses.dataclass
class Comparison:
    """H against R for one case, per layer (compress ratio) and in all."""
    rows_compared: int
    max_abs_diff: list           # per layer: attention outputs of rows >= F (and a neighbour's)
    outputs_bit_equal: list      # per layer
    pool_bytes_differing: list   # per layer: the request's view (SWA [F-128, L); latents /
    differing_views: list        #   index keys of groups in [s, L)), bytes
    decode_steps: int
    decode_max_abs_diff: list    # per layer
    decode_bit_equal: list       # per layer

    def layer_bit_equal(self, i: int) -> bool:
        return (self.outputs_bit_equal[i] and not self.pool_bytes_differing[i]
                and self.decode_bit_equal[i])

    @property
    def bit_equal(self) -> bool:
        return all(self.layer_bit_equal(i) for i in range(len(RATIOS)))

    @property
    def worst(self) -> float:
        return max(self.max_abs_diff + self.decode_max_abs_diff)


@dataclasses.dataclass
class Run:
    extend: dict                 # position -> per-layer outputs
    view: dict
    decode: dict
    evicted_reads: int = 0       # SWA reads (valid top-k entries) of evicted slots, all rows
    evicted_read_rows: list = dataclasses.field(default_factory=list)


# ---- the harness -------------------------------------------------------------------------------

class Harness:
    """Builds the document once, then runs H and R per case in two reusable worlds."""

    DOC_SLOT, REQ_SLOT, NEIGHBOR_SLOT = 0, 1, 2

    def __init__(self, *, doc: int = DOC, tokens_key: int = 512,
                 progress: Callable[[str], None] | None = None):
        from adapter import installer, swa_cone
        from adapter.cpu.dsv4 import attention as dsv4_attention

        dsv4_attention.prepare()
        self.progress = progress or (lambda msg: None)
        self.doc_len = doc
        self.fresh_page = doc // PAGE + 2
        self._route = contextlib.ExitStack()
        self._route.enter_context(dsv4_attention.cpu_route())
        status = installer.install_in_process({"DSV41_SWA_CONE_REPLAY": "1",
                                               "DSV41_SWA_CONE_TOKENS": str(tokens_key)})
        if status["swa_cone"].status != "installed":
            raise RuntimeError(f"swa_cone not installed: {status['swa_cone'].detail}")
        self.cone = swa_cone.state()
        self.stack = Stack()
        pages = self.fresh_page + CONTEXT // PAGE
        self.H = World(self.stack, full_pages=pages, swa_pages=pages)
        self.R = World(self.stack, full_pages=pages, swa_pages=pages)
        # What cone's match side reads to decide whether to plan (None: it plans here).
        self.served_by = swa_cone.forward_side()
        self.backend_class = type(self.R.backend)
        t0 = time.process_time()
        self.doc = self._document()
        self.doc_seconds = time.process_time() - t0
        self.progress(f"document [0,{doc}) prefilled in {self.doc_seconds:.1f} s CPU")

    def close(self) -> None:
        from adapter import installer

        self.R.close()           # overrides restore in reverse order of install
        self.H.close()
        self._route.close()
        installer.reset_for_tests()

    def hooks_installed(self) -> bool:
        """Cone's forward hooks wrap the backend class's own methods (HookRegistry wrappers
        whose unwrapped function is the engine's)."""
        from adapter import pins

        cls = self.backend_class
        return all(cls.__dict__[m] is not pins.original_callable(cls.__dict__[m])
                   and pins.original_callable(cls.__dict__[m]).__qualname__ == f"{cls.__name__}.{m}"
                   for m in ("_build_forward_metadata", "init_forward_metadata_prefill"))

    # -- worlds -----------------------------------------------------------------------------

    def _document(self) -> dict:
        """The document [0, D) prefilled in chunks on full pages 1..D/256 (SWA page = full page)."""
        w = self.H
        pages = torch.arange(1, self.doc_len // PAGE + 1)
        loc = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
        w.req_to_token[self.DOC_SLOT, :self.doc_len] = loc.to(w.req_to_token.dtype)
        w.mapping[loc] = loc
        for start in range(0, self.doc_len, DOC_CHUNK):
            w.forward([("doc", self.DOC_SLOT, start, min(self.doc_len, start + DOC_CHUNK), 0)])
        return w.snapshot()

    def _request(self, world: World, *, resident: int, start: int, end: int,
                 neighbor: int = 0) -> torch.Tensor:
        """Request slot: the document's pages for [0, resident), fresh pages (full and SWA) for
        [start, end + DECODE_STEPS), in order, as the allocator hands a request its pages."""
        r2t = world.req_to_token
        r2t[self.REQ_SLOT].zero_()
        r2t[self.REQ_SLOT, :resident] = r2t[self.DOC_SLOT, :resident]
        n = end + DECODE_STEPS - start
        pages = torch.arange(self.fresh_page, self.fresh_page + -(-n // PAGE))
        fresh = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()[:n]
        r2t[self.REQ_SLOT, start:end + DECODE_STEPS] = fresh.to(r2t.dtype)
        world.mapping[fresh] = fresh
        if neighbor:
            first = self.fresh_page + CONTEXT // PAGE // 2
            loc = (first * PAGE + torch.arange(neighbor))
            r2t[self.NEIGHBOR_SLOT].zero_()
            r2t[self.NEIGHBOR_SLOT, :neighbor] = loc.to(r2t.dtype)
            world.mapping[loc] = loc
        return fresh[:end - start]

    def _stale_fresh_pages(self, world: World, loc: torch.Tensor) -> None:
        """Fresh pages hold stale data: latents and index keys of something else."""
        from adapter.cpu.dsv4.attention import store_index_k, store_k

        g = torch.Generator().manual_seed(NOISE_SEED + 1)
        for layer_id, ratio in enumerate(RATIOS):
            if not ratio:
                continue
            slots = torch.unique(loc // ratio)
            buf, page = world.latent_buffer(layer_id)
            store_k(buf, slots, torch.randn(slots.numel(), DIM, generator=g), page)
            if ratio == 4:
                buf, page = world.index_buffer(layer_id)
                store_index_k(buf, slots, torch.randn(slots.numel(), 128, generator=g), page)

    def _evict(self, world: World, *, overwrite: bool) -> torch.Tensor:
        """The session's SWA is evicted: the engine's allocator clears a freed slot's mapping to
        0 (the padding slot); the harness then overwrites the freed SWA pages and the padding
        page with large noise, so any read of them shows (unless `overwrite` is False). Returns
        the evicted SWA slots as a mask."""
        from adapter.cpu.dsv4.attention import store_k

        doc_loc = world.req_to_token[self.DOC_SLOT, :self.doc_len].to(torch.int64)
        freed = world.mapping[doc_loc].clone()
        world.mapping[doc_loc] = 0
        evicted = torch.zeros(world.mapping.numel(), dtype=torch.bool)
        evicted[:PAGE] = True
        evicted[freed] = True
        if overwrite:
            g = torch.Generator().manual_seed(NOISE_SEED)
            page_size = world.pool.swa_kv_pool.page_size
            pages = torch.unique(torch.nonzero(evicted).flatten() // page_size)
            for layer_id in range(len(RATIOS)):
                buf = world.swa_buffer(layer_id)
                # One page of noise rows, written with the kit's setter, copied to every page.
                store_k(buf, torch.arange(page_size),
                        torch.randn(page_size, DIM, generator=g) * 1e3, page_size)
                buf[pages] = buf[0].clone()
        return evicted

    # -- runs -------------------------------------------------------------------------------

    def _run(self, world: World, rid: str, bounds: list, case: Case, audit=None) -> tuple:
        """Extend passes over `bounds`, the first beside the neighbour request (if the case has
        one), then DECODE_STEPS decode steps. Outputs keyed by position (neighbour: -1 - pos)."""
        ext = {}
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            segments = [(rid, self.REQ_SLOT, a, b, 0)]
            if i == 0 and case.neighbor:
                segments.insert(0, ("X", self.NEIGHBOR_SLOT, 0, case.neighbor, NEIGHBOR_SALT))
            outs = world.forward(segments, audit=audit and audit(segments))
            keys = [-1 - p for p in range(case.neighbor)] if i == 0 and case.neighbor else []
            keys += list(range(a, b))
            for row, key in enumerate(keys):
                ext[key] = tuple(o[row] for o in outs)
        dec = {}
        for p in range(case.L, case.L + DECODE_STEPS):
            segments = [(rid, self.REQ_SLOT, p, p + 1, 0)]
            outs = world.forward(segments, decode=True, audit=audit and audit(segments))
            dec[p] = tuple(o[0] for o in outs)
        return ext, dec

    @staticmethod
    def r_bounds(case: Case) -> list:
        """R's passes: [s, s + chunk), ... up to L (the replay is one chunked prefill from s)."""
        return sorted({*range(case.s, case.L, case.chunk), case.L})

    @classmethod
    def h_bounds(cls, case: Case, *, aligned: bool = True) -> list:
        """H's passes over [F, L). Aligned: they end where R's do, so a row >= F sits in a batch
        with the same longest row in H and R (the engine's torch top-k breaks score ties by
        position in a logits row as wide as the batch's longest c4 length, in pages). Not
        aligned: chunks from F, as a scheduler would cut them."""
        if aligned:
            return [case.F] + [b for b in cls.r_bounds(case) if b > case.F]
        return sorted({*range(case.F, case.L, case.chunk), case.L})

    def run_h(self, case: Case, *, aligned: bool = True) -> Run:
        w = self.H
        w.load(self.doc)
        self._request(w, resident=case.F, start=case.F, end=case.L, neighbor=case.neighbor)
        ext, dec = self._run(w, "H", self.h_bounds(case, aligned=aligned), case)
        view = request_view(w, self.REQ_SLOT, swa_from=case.F - WINDOW, groups_from=case.s,
                            end=case.L)
        return Run(ext, view, dec)

    def run_r(self, case: Case, *, overwrite_evicted: bool = True, disable: tuple = ()) -> Run:
        """Cone's replay from s. `disable` switches off steps of cone's forward side (controls):
        "copy", "mask", "floor"."""
        from adapter import swa_cone_copy
        from adapter.swa_cone import Plan

        w = self.R
        w.load(self.doc)
        evicted = self._evict(w, overwrite=overwrite_evicted)
        fresh = self._request(w, resident=case.s, start=case.s, end=case.L,
                              neighbor=case.neighbor)
        self._stale_fresh_pages(w, fresh)
        # The plan as Cone._commit makes it: the resident full slots of [s, F) on the tree path.
        src = w.req_to_token[self.DOC_SLOT, case.s:case.F].to(device="cpu", dtype=torch.int64)
        self.cone.plans.clear()
        self.cone.plans["R"] = Plan(rid="R", F=case.F, s=case.s, L=case.L, src_loc=src.clone())
        copies = self.cone.counters["copies"]
        reads = {"n": 0, "rows": set()}

        def audit(segments):
            row_pos = torch.cat([torch.arange(a, b) if rid == "R" else torch.full((b - a,), -1)
                                 for rid, _, a, b, _ in segments])

            def check(md):
                idx = md.swa_page_indices
                idx = idx.reshape(idx.shape[0], -1)
                n = md.swa_topk_lengths.reshape(-1)[:idx.shape[0]].to(torch.int64)
                valid = (torch.arange(idx.shape[1])[None, :] < n[:, None]) & (idx >= 0)
                hit = valid & evicted[idx.clamp_min(0).to(torch.int64)]
                reads["n"] += int(hit.sum())
                reads["rows"].update(row_pos[torch.nonzero(hit.any(1)).flatten()].tolist())
            return check

        with _disabled(swa_cone_copy, disable):
            ext, dec = self._run(w, "R", self.r_bounds(case), case, audit=audit)
        if "R" in self.cone.plans:
            raise AssertionError("cone's plan was not consumed by the first pass")
        if "copy" not in disable and self.cone.counters["copies"] != copies + 1:
            raise AssertionError("cone did not copy")
        view = request_view(w, self.REQ_SLOT, swa_from=case.F - WINDOW, groups_from=case.s,
                            end=case.L)
        # The audit counts each (row, slot) read once per layer.
        return Run(ext, view, dec, reads["n"], sorted(reads["rows"]))

    @staticmethod
    def compare(case: Case, h: Run, r: Run) -> Comparison:
        n = len(RATIOS)
        rows = list(range(case.F, case.L)) + [-1 - p for p in range(case.neighbor)]
        diff, equal = [0.0] * n, [True] * n
        for p in rows:
            for i, (a, b) in enumerate(zip(h.extend[p], r.extend[p])):
                diff[i] = max(diff[i], _max_diff(a, b))
                equal[i] = equal[i] and torch.equal(a, b)
        differing, nbytes = [], [0] * n
        for key, (pos, hb) in h.view.items():
            rpos, rb = r.view[key]
            assert torch.equal(pos, rpos)
            bad = (hb != rb).any(1)
            if bool(bad.any()):
                kind, layer = key
                nbytes[layer] += int((hb != rb).sum())
                width = 1 if kind == "swa" else RATIOS[layer]
                differing.append(f"{kind} layer {layer} (c{RATIOS[layer]}) at positions "
                                 f"{_ranges(pos[bad].tolist(), width)}")
        ddiff, dequal = [0.0] * n, [True] * n
        for p in h.decode:
            for i, (a, b) in enumerate(zip(h.decode[p], r.decode[p])):
                ddiff[i] = max(ddiff[i], _max_diff(a, b))
                dequal[i] = dequal[i] and torch.equal(a, b)
        return Comparison(len(rows), diff, equal, nbytes, differing, len(h.decode), ddiff,
                          dequal)

    @staticmethod
    def rows_diff(a: Run, b: Run, lo: int, hi: int) -> float:
        """Max |diff| of two runs' outputs over positions [lo, hi), every layer."""
        return max((_max_diff(x, y) for p in range(lo, hi) if p in a.extend
                    for x, y in zip(a.extend[p], b.extend[p])), default=0.0)

    def spread(self, case: Case) -> float:
        """The torch path's own spread: H of `case` run twice, same batches."""
        a, b = self.run_h(case), self.run_h(case)
        return self.compare(case, a, b).worst

    def composition_spread(self, case: Case) -> Comparison:
        """The engine's own spread across batch compositions: H with passes aligned to R's
        against H chunked from F (no cone involved in either)."""
        return self.compare(case, self.run_h(case, aligned=True), self.run_h(case, aligned=False))


# ---- cases and controls as the bench and the tests run them -----------------------------------

CONTROL_CASE = CASES[0]
CONE_CASE = Case("N=256 inside the stack's cone", s=1792, F=2048, L=2049, chunk=256,
                 note="copy, mask and floor on; N below 3 x 127")

CONTROLS = {
    "no copy": "skips swa_cone_copy.copy_resident in Cone.apply (run by the "
               "DeepseekV4AttnBackend._build_forward_metadata hook): the replay rows' fresh "
               "pages keep their stale latents / index keys",
    "no write mask": "swa_cone_copy.keep_rows returns None, so Cone.apply (the "
                     "_build_forward_metadata hook) leaves ForwardBatch.encoder_swa_compress_rows "
                     "unset and the engine's _compressor_out_loc keeps the replay rows' own "
                     "c4 / c128 / index-key out locs",
    "no window floor": "swa_cone_copy.row_floor returns None: neither encoder_swa_row_floor (the "
                       "_build_forward_metadata hook) nor swa_replay_start (the "
                       "init_forward_metadata_prefill hook) is set",
    "evicted slots left with their old contents": "harness step skipped: after eviction "
                                                   "(mapping cleared to the padding slot, as the "
                                                   "engine does) the freed SWA pages and the "
                                                   "padding page keep their contents; the window "
                                                   "floor is off as in the control above",
    "N inside the exact cone": "switches nothing off: N = 256 is below the stack's cone (3 SWA "
                               "layers x 127 rows), so the rebuilt window [F-128, F) comes from "
                               "rows the floor still reaches",
}


def run_control(h: Harness, name: str, ok: dict, tolerance: float, *,
                case: Case = CONTROL_CASE, cone_case: Case = CONE_CASE) -> dict:
    """One negative control on `case`; `ok` holds its H and cone-replay R runs ("H", "R"), and
    collects the unfloored run for the next control."""
    t0 = time.process_time()
    extra = {}
    if name == "no copy":
        c = h.compare(case, ok["H"], h.run_r(case, disable=("copy",)))
        diff, extra = c.worst, {"views": c.differing_views}
        metric = "rows >= F (outputs, decode) vs H"
    elif name == "no write mask":
        r = h.run_r(case, disable=("mask",))
        c = h.compare(case, ok["H"], r)
        diff = c.worst
        overwritten = [v for v in c.differing_views if not v.startswith("swa")]
        extra = {"overwrote": _resident_rows(overwritten), "views": c.differing_views}
        metric = "rows >= F (outputs, decode) vs H"
    elif name in ("no window floor", "evicted slots left with their old contents"):
        overwrite = name == "no window floor"
        r = h.run_r(case, disable=("floor",), overwrite_evicted=overwrite)
        c = h.compare(case, ok["H"], r)
        if overwrite:
            ok["no floor"] = r
            diff = h.rows_diff(r, ok["R"], case.s, case.F)
            metric = "replay rows [s, F) vs the floored replay (reads of evicted slots)"
        else:
            diff = h.rows_diff(r, ok["no floor"], case.s, case.F)
            metric = ("replay rows [s, F) vs the same unfloored replay with the evicted slots "
                      "overwritten")
        extra = {"rows_ge_F_max_abs_diff": c.worst, "evicted_slot_reads": r.evicted_reads,
                 "rows_reading_evicted": _ranges(r.evicted_read_rows, 1)}
    elif name == "N inside the exact cone":
        c = h.compare(cone_case, h.run_h(cone_case), h.run_r(cone_case))
        diff, extra = c.worst, {"views": c.differing_views}
        metric = "rows >= F (outputs, decode) vs H"
    else:
        raise KeyError(name)
    return {"name": name, "max_abs_diff": diff, "detected": bool(diff > tolerance),
            "disables": CONTROLS[name], "metric": metric,
            "seconds": round(time.process_time() - t0, 1), **extra}


def _resident_rows(views: list) -> str:
    return "; ".join(v.replace(" at positions", " of resident rows") for v in views) or "none"


@contextlib.contextmanager
def _disabled(cc, steps: tuple):
    """Switch off steps of cone's forward side for a control, at the functions Cone.apply calls:
    copy -> swa_cone_copy.copy_resident, mask -> swa_cone_copy.keep_rows (no
    encoder_swa_compress_rows), floor -> swa_cone_copy.row_floor (no encoder_swa_row_floor, no
    swa_replay_start)."""
    saved = {}
    if "copy" in steps:
        saved["copy_resident"] = cc.copy_resident
        cc.copy_resident = lambda pool, src, dst, *, page_size: cc.CopyReport(0, 0, 0)
    if "mask" in steps:
        saved["keep_rows"] = cc.keep_rows
        cc.keep_rows = lambda *a, **k: None
    if "floor" in steps:
        saved["row_floor"] = cc.row_floor
        cc.row_floor = lambda *a, **k: None
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(cc, name, value)


def _ranges(values: list, width: int) -> str:
    """[a, b) ranges of positions (each covering `width` tokens)."""
    if not values:
        return ""
    out, start, prev = [], values[0], values[0]
    for v in values[1:]:
        if v != prev + width:
            out.append(f"[{start},{prev + width})")
            start = v
        prev = v
    out.append(f"[{start},{prev + width})")
    return " ".join(out)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
