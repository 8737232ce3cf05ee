"""Drop-in adapters for serving engines' store calls: the engine's names, arguments and cache
bytes, plus kvwrite's bounds check (keyword-only `check=` and `errors=`). One module per engine;
each maps the engine's convention onto kvwrite's ops (no second copy of any kernel)."""
