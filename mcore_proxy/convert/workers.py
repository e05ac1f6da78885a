"""Worker processes that never outlive the converter.

`run_workers(fn, jobs)` runs `fn(*job)` for every job in its own spawned process and returns the
results in job order; with `on_progress`, `fn` gets a `progress(n)` keyword whose counts reach
`on_progress(n)` in the parent as they happen. A worker that raises sends its exception back (re-raised here: a
ProxyError keeps its sentence and exit code 2); a worker that dies without a word is an
InternalError. On the first failure, on a signal in the parent (Interrupted) or on any other
exit, every worker still running is killed and reaped before this returns, so the caller may
remove the staging folder knowing nothing writes into it any more. Workers also die with the
parent if the parent is killed outright (`interrupts.as_worker`).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os

from mcore_proxy.core.errors import InternalError


def _main(conn, parent_pid: int, fn, args, with_progress: bool) -> None:
    from mcore_proxy.runtime import interrupts

    interrupts.as_worker(parent_pid)
    try:
        kwargs = {"progress": lambda n: conn.send(("progress", n))} if with_progress else {}
        result = ("ok", fn(*args, **kwargs))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which decides
        try:
            import pickle

            pickle.dumps(err)
            result = ("error", err)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: keep its text
            result = ("error", InternalError(f"{type(err).__name__}: {err}"))
    conn.send(result)
    conn.close()


def run_workers(fn, jobs: list[tuple], on_done=None, on_progress=None) -> list:
    """Run `fn(*job)` per job in spawned processes; `on_done(i)` after job i finishes."""
    ctx = mp.get_context("spawn")  # fork after torch/megatron imports is not safe
    procs, conns = [], []
    try:
        for job in jobs:
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_main, args=(send, os.getpid(), fn, job, on_progress is not None), daemon=True)
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        results: dict[int, object] = {}
        waiting = dict(enumerate(conns))
        while waiting:
            ready = multiprocessing.connection.wait(list(waiting.values()) + [procs[i].sentinel for i in waiting])
            for i, conn in list(waiting.items()):
                if conn not in ready and procs[i].sentinel not in ready:
                    continue
                try:
                    status, value = conn.recv()
                except EOFError:
                    procs[i].join()
                    raise InternalError(
                        f"writer process {i} died with exit code {procs[i].exitcode} before reporting"
                    ) from None
                if status == "progress":
                    on_progress(value)
                    continue
                del waiting[i]
                if status == "error":
                    raise value
                results[i] = value
                if on_done is not None:
                    on_done(i)
        return [results[i] for i in range(len(jobs))]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        for c in conns:
            c.close()
