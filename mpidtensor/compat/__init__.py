"""Unchanged torch.distributed programs on mpidtensor: the switch that gives user code
mpidtensor's modules under torch's import paths while torch's own code keeps torch's.

- :mod:`.aliases`: the table, torch module path -> mpidtensor module path;
- :mod:`.views`: the module objects user code receives (aliases, proxies of torch's
  parent packages, stand-ins for what mpidtensor lacks);
- :mod:`.importer`: the ``__import__`` / ``importlib.import_module`` hook;
- :mod:`.switch`: :func:`install_torch_distributed`, the explicit process-wide effect.

docs/unchanged-programs.md explains the design.
"""
