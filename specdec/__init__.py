"""specdec: speculative decoding served over gRPC (draft service, target service, orchestrator)."""
from specdec.client import AsyncClient, Client, GenerationResult

__all__ = ["Client", "AsyncClient", "GenerationResult"]
__version__ = "0.1.0"
