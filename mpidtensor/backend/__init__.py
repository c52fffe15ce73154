"""torch.distributed on MPI: the c10d backend third-party code reaches through
``torch.distributed`` (``init_process_group``, collectives, ``new_group``, point-to-point).

- :mod:`.process_group`: the ``"mpidtensor"`` ``ProcessGroup`` backend on an MPI communicator;
- :mod:`.c10d_checks`: its argument checks, raising what torch's gloo raises;
- :mod:`.monitored_barrier`: ``monitored_barrier`` as gloo runs it;
- :mod:`.rendezvous`: ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` ... from MPI (the one rendezvous);
- :mod:`.distributed`: what ``torch.distributed`` gives user code under the switch;
- :mod:`.mesh_groups`: c10d collectives given a mesh's group (an MPI communicator);
- :mod:`.funcol`: ``torch.distributed._functional_collectives`` under the switch;
- :mod:`.cpp_groups`: torch's C++-backed utilities given a mesh's group (a clear ``TypeError``).
"""
