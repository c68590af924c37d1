"""The torch.compile door: ``backend="mpmd"`` (backend), what a compiled call
runs (door), and the function Dynamo handed the backend, called again (frame).

Depends on: graph, runtime, the public front (api builds the pipeline).
"""
