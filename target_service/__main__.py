"""python -m target_service [--config FILE] [--port N] ... (every config field of [target] is a flag)"""
from specdec.service import run_service
from target_service.server import serve

if __name__ == "__main__":
    run_service("target", serve)
