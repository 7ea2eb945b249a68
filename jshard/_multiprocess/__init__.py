"""Multi-process jobs: joining one, agreeing across processes, launching local ones."""
