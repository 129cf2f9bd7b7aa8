"""The endpoints, one APIRouter per API family; `ROUTERS` is the order build_app includes them in."""

from __future__ import annotations

from . import cohere, embeddings, sagemaker, score, utility

ROUTERS = (embeddings.router, score.router, cohere.router, utility.router, sagemaker.router)
