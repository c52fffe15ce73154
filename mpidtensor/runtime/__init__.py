"""Job-wide machinery under everything else: settings, caches, process-wide effects, the
agreement of errors across ranks, abort and watchdog, MPI progress and library facts."""
