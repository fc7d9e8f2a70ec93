"""python -m orchestrator [--config FILE] [--port N] ... (every config field of [orchestrator] is a flag)"""
from specdec.service import run_service
from orchestrator.server import serve

if __name__ == "__main__":
    run_service("orchestrator", serve)
