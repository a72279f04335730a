"""dsv41: env-gated SGLang runtime adapters for DeepSeek V4.1 Flash (release v2.6.4).

Nothing here imports torch or sglang at import time; the installer imports engine modules only
when a DSV41_* key enables an adapter that targets them.
"""
__version__ = "2.6.4"
