"""python -m draft_service [--config FILE] [--port N] ... (every config field of [draft] is a flag)"""
from specdec.service import run_service
from draft_service.server import serve

if __name__ == "__main__":
    run_service("draft", serve)
