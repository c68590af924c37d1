"""Stage programs: the joint graph of a stage -> functional F, B and the I/W
halves of B (stage_programs; the cut into F and B: partition), joint graphs
and their cuts kept for the process (export_memo), the weight-gradient
half's plan (weight_grad), and the loss contract both runners call (loss).

Depends on: torch_mpmd._C, graph.
"""
