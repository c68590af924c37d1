"""Module -> stage graphs: Dynamo capture (capture), the stage marker (markers),
FX -> C++ graph IR (fx_to_ir), per-stage GraphModules from the C++ partition
plan (stage), and the symbolic sizes of a dynamic capture (shapes).

Depends on: torch_mpmd._C, microbatch.
"""
