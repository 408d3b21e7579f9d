"""engine="ray": the same job on Ray Data actors (``pip install 'cyformer[ray]'``).

The driver reads the corpus and cuts the rows of the shards still to do
into blocks of ``batch_docs`` documents; ``map_batches`` runs them on a pool
of ``workers`` actors (a callable class that loads the model once, with
``threads`` kernel threads and ``num_cpus=threads``).  Each actor returns,
per document, its result (pickled) or why it was skipped; the driver
gathers them by shard and writes a shard with the same writer as the local
engine as soon as all its rows are back.  Results come back in any order
and, after a retry, possibly twice: a row's first result is kept (a rerun
computes the same bytes), so the shards are the local engine's, byte for
byte.

An actor that dies is restarted by Ray and its unfinished batches run
again (Ray Data's actor pools retry without limit by default).
"""

import os
import pickle

from ..errors import CyformerError
from .job import RowSkipped


class _JobWorker:
    """One Ray actor: the model, loaded once, and the job."""

    def __init__(self, model, threads, job):
        import cyformer

        self.model = cyformer.load(model, threads=threads)
        self.job = job
        job.check(self.model)

    def __call__(self, batch):
        import pyarrow as pa

        shards, rows, ok, payload = [], [], [], []
        for shard, row, text, params in zip(batch.column("shard").to_pylist(), batch.column("row").to_pylist(),
                                            batch.column("text").to_pylist(),
                                            batch.column("params").to_pylist()):
            try:
                result = self.job.process(self.model, row, text, pickle.loads(params))
                ok.append(True)
                payload.append(pickle.dumps(result, protocol=5))
            except RowSkipped as e:
                ok.append(False)
                payload.append(str(e).encode("utf-8"))
            shards.append(shard)
            rows.append(row)
        return pa.table({"shard": pa.array(shards, pa.int64()), "row": pa.array(rows, pa.int64()),
                         "ok": pa.array(ok, pa.bool_()), "payload": pa.array(payload, pa.binary())})


_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_local_ray(num_cpus=None):
    """Start a Ray cluster on this machine whose servers listen on loopback only.

    Ray replaces a node address of 127.0.0.1 by the machine's routable address
    and then binds its gRPC servers to every interface, unless it believes
    clusters are switched off (as on macOS and Windows); saying so for the
    time of the start keeps GCS, raylet and workers on 127.0.0.1.  The
    processes started here inherit the setting, the caller's environment
    is restored afterwards.
    """
    import ray
    from ray._private import ray_constants

    saved_env, saved_flag = os.environ.get(_LOCAL_ONLY), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_LOCAL_ONLY] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, configure_logging=False)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_LOCAL_ONLY, None)
        else:
            os.environ[_LOCAL_ONLY] = saved_env


def _connect(address, workers, threads):
    import ray

    if not ray.is_initialized():
        if address is None:  # a local cluster on this machine's cores, reachable from here only
            init_local_ray()
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    cpus = int(ray.cluster_resources().get("CPU", 0))
    threads = 1 if threads is None else threads
    if workers is None:
        workers = max(1, cpus // threads)
    if workers * threads > cpus:
        raise CyformerError(f"ray: {workers} workers x {threads} threads need {workers * threads} CPUs; "
                            f"the cluster has {cpus}")
    return workers, threads


def run_on_ray(job, model, todo, out, shard_rows, *, workers, threads, address, finished, bar,
               batch_docs=8):
    """Compute the shards ``todo`` ([(index, rows)]) on Ray; call
    ``finished(record)`` for each shard once written."""
    try:
        import pyarrow as pa
        import ray
    except ImportError:
        raise CyformerError("engine='ray' needs Ray Data: pip install 'cyformer[ray]'") from None
    from .shards import write_shard

    workers, threads = _connect(address, workers, threads)
    pending = {}   # shard -> {"first", "n", "want" (rows to wait for), "results", "skipped"}
    blocks = []
    for k, rows in todo:
        state = {"first": k * shard_rows, "n": len(rows), "want": set(), "results": {}, "skipped": []}
        pending[k] = state
        good = []
        for r in rows:
            params = None
            if r.error is None:
                try:
                    params = job.row_params(r)
                except RowSkipped as e:
                    r.error = str(e)
            if r.error is not None:
                state["skipped"].append((r.index, r.where, r.error))
            else:
                good.append((r, params))
                state["want"].add(r.index)
        state["where"] = {r.index: r.where for r in rows}
        for a in range(0, len(good), batch_docs):
            part = good[a:a + batch_docs]
            blocks.append(pa.table({
                "shard": pa.array([k] * len(part), pa.int64()),
                "row": pa.array([r.index for r, _ in part], pa.int64()),
                "text": pa.array([r.text for r, _ in part], pa.string()),
                "params": pa.array([pickle.dumps(p) for _, p in part], pa.binary()),
            }))

    def write(k):
        st = pending.pop(k)
        finished(write_shard(job, out, k, st["first"], st["n"], list(st["results"].items()), st["skipped"]))

    for k, st in list(pending.items()):  # malformed rows need no worker
        bar.update(len(st["skipped"]), 0)
        if not st["want"]:
            write(k)
    if not blocks:
        return

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ds = ray.data.from_arrow(blocks).map_batches(
        _JobWorker, fn_constructor_kwargs={"model": model if model is None else os.fspath(model), "threads": threads, "job": job},
        batch_size=None, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=workers),
        num_cpus=threads)
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=0):
        for k, row, ok, payload in zip(batch.column("shard").to_pylist(), batch.column("row").to_pylist(),
                                       batch.column("ok").to_pylist(), batch.column("payload").to_pylist()):
            s = pending.get(k)
            if s is None or row not in s["want"]:  # a retried batch's second answer
                continue
            s["want"].discard(row)
            if ok:
                result = pickle.loads(payload)
                s["results"][row] = result
                bar.update(1, job.tokens(result))
            else:
                s["skipped"].append((row, s["where"][row], payload.decode("utf-8")))
                bar.update(1, 0)
            if not s["want"]:
                write(k)
    if pending:
        raise CyformerError(f"ray: shards {sorted(pending)[:10]} did not come back complete")

