"""One module per route group; each exposes ``router`` (a FastAPI ``APIRouter``)."""
