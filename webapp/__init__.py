"""webapp: the Shinken session server.

``webapp.app.create_app`` builds the single-process server (session core in
process); ``webapp.router.create_app`` builds the thin multi-process router.
This package root imports neither, so the router process never loads the
session core or a tokenizer.
"""
