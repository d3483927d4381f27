"""Running ASGI apps, shared by the product's server (`recursa.serve`) and the fake model server
(`recursa.testing`) so that neither depends on the other. Needs the `server` extra (uvicorn)."""
