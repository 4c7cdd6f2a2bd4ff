"""What the docs build generates: measured figures and tables from results files, the results pages,
the troubleshooting page. Used by docs/hooks.py (mkdocs) and by tests/test_docs*.py; imports nothing
of ln_lightning except where a renderer needs an example's own report function."""
