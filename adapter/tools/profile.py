"""The production profile file (.env.tp4.example): docker --env-file style, one line per var.

A profile *line* is a pair of variables: EXTRA_CONTAINER_ENV (KEY=value words for the container)
and EXTRA_SGLANG_ARGS (launch arguments). `--line production` names the plain pair; any other
line NAME names EXTRA_CONTAINER_ENV_NAME / EXTRA_SGLANG_ARGS_NAME.

A *test line* is one whose name is `test` or starts with `test_` (EXTRA_CONTAINER_ENV_TEST,
EXTRA_CONTAINER_ENV_TEST_<X>): the only lines that may carry a test-only key (adapter/keys.py
`Key(..., test_only=True)`, `dsv41 keys` marks them). `refuse_test_only` is what `dsv41 check`,
`dsv41 canary` and `dsv41 gate boot` run on every line they read.
"""
from __future__ import annotations

import dataclasses
import pathlib
import shlex

ENV_VAR = "EXTRA_CONTAINER_ENV"
ARGS_VAR = "EXTRA_SGLANG_ARGS"
TEST_LINE = "test"          # a line named `test` or `test_*` is a test line


class ProfileError(Exception):
    pass


@dataclasses.dataclass(frozen=True)
class Line:
    name: str
    env: dict            # KEY -> value, in line order
    args: tuple          # launch arguments

    @property
    def is_test(self) -> bool:
        return is_test_line(self.name)

    def arg_value(self, flag: str):
        if flag in self.args:
            i = self.args.index(flag)
            return self.args[i + 1] if i + 1 < len(self.args) else None
        return None


def read_vars(path) -> dict[str, str]:
    out = {}
    for n, raw in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        name, sep, value = text.partition("=")
        if not sep or not name.isidentifier():
            raise ProfileError(f"{path}:{n}: not a NAME=value line: {raw!r}")
        words = shlex.split(value, comments=False)
        out[name] = words[0] if len(words) == 1 else value.strip()
    return out


def parse_env_words(text: str) -> dict[str, str]:
    env = {}
    for word in shlex.split(text):
        key, sep, value = word.partition("=")
        if not sep:
            raise ProfileError(f"{ENV_VAR}: {word!r} is not KEY=value")
        if key in env:
            raise ProfileError(f"{ENV_VAR}: {key} appears twice")
        env[key] = value
    return env


def line_names(path) -> list[str]:
    names = []
    for var in read_vars(path):
        if var == ENV_VAR:
            names.append("production")
        elif var.startswith(ENV_VAR + "_"):
            names.append(var[len(ENV_VAR) + 1:].lower())
    return names


def load_line(path, name: str = "production") -> Line:
    variables = read_vars(path)
    suffix = "" if name == "production" else "_" + name.upper()
    if ENV_VAR + suffix not in variables:
        raise ProfileError(f"{path}: no line {name!r} ({ENV_VAR + suffix} is not set); "
                           f"lines: {', '.join(line_names(path))}")
    return Line(name, parse_env_words(variables[ENV_VAR + suffix]),
                tuple(shlex.split(variables.get(ARGS_VAR + suffix, ""))))


def line_from_text(text: str, name: str = "inline") -> Line:
    """A line given on the command line: KEY=value words and --args in one string."""
    words = shlex.split(text)
    env = parse_env_words(" ".join(shlex.quote(w) for w in words if "=" in w and not w.startswith("-")))
    args = tuple(w for w in words if not ("=" in w and not w.startswith("-")))
    return Line(name, env, args)


def is_test_line(name: str) -> bool:
    """A line named `test` or `test_*` (any case): the only kind that may set a test-only key."""
    name = name.lower()
    return name == TEST_LINE or name.startswith(TEST_LINE + "_")


def refuse_test_only(line: Line) -> None:
    """Raise keys.ConfigError naming every test-only key set on a line that is not a test line."""
    from adapter import keys

    found = [k for k in keys.test_only_keys(line.env)]
    if found and not line.is_test:
        names = ", ".join(f"{k.name}={line.env[k.name]}" for k in found)
        raise keys.ConfigError(
            f"line {line.name!r} sets the test-only key{'s' if len(found) > 1 else ''} {names} "
            f"({'; '.join(k.doc for k in found)}): a test-only key belongs on a test line only "
            f"(named {TEST_LINE} or {TEST_LINE}_*), never on {line.name!r}; delete it from the line")
