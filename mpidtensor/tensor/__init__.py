"""The distributed tensor: placements, specs and layouts, DTensor, redistribution, and
the public constructors (distribute_tensor/module, factories)."""
