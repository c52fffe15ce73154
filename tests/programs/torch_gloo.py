"""Run a torch.distributed program on torch itself (gloo) under mpiexec, as torchrun would
start it: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from
MPI, then the script as __main__. The reference the switch's runs are compared with.
Usage: mpiexec -n N python torch_gloo.py script.py [args...]"""
import os
import runpy
import sys

from mpidtensor.backend.rendezvous import launcher_environment

os.environ.update(launcher_environment())
if os.environ["MASTER_ADDR"] == "127.0.0.1":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
