"""Tools that keep the docs true to the code: exhibits (figures and quoted numbers), generated regions,
and snippet runs. `python docs/tools/make_docs.py` writes them; tests/test_docs.py checks them."""
