"""The driver: runs every chain against the shards, one round trip at a time.

FlyMC is a composite Gibbs kernel: each iteration first updates the brightness
variables z given θ (on the shards), then moves θ given z with a θ-kernel. The
conditional target of θ given z is

    log p(θ | z, x) = log p(θ) + Σ_all β_n(θ) + Σ_bright log L~_n(θ) + const,

where the collapsed bound Σ_all β_n is a quadratic form the driver holds (summed
once from the shards' sufficient statistics), and the bright sum comes back from
the shards every round trip. Regular MCMC is the same loop with the full
likelihood Σ_n l_n in place of the bright sum and no bound.

The round-trip protocol (one call to all shards carries every chain):

1. first round trip of an iteration: each shard commits each chain's previous
   decision (the row of the chain's last evaluated points that became current),
   updates z at the committed θ, evaluates the points the chain's kernel asked
   for, and returns sums (and the sum at the current θ, which z changed);
2. later round trips of the same iteration (slice, MALA): evaluation only.

RWMH therefore costs exactly one round trip per iteration for all chains.
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import numpy as np

from flymc_dist.ahead import ReadAhead, fitting_depth
from flymc_dist.kernels.adaptation import INFO_ATTRIBUTES
from flymc_dist.kernels.base import (
    EvalRequest,
    EvalResponse,
    Kernel,
    KernelInfo,
    params_from_json,
    params_to_json,
)
from flymc_dist.models.base import BoundStats, Model
from flymc_dist.options import FlyMC, Regular, RunSettings
from flymc_dist.progress import SetupProgress, map_search_rows
from flymc_dist.protocol import (
    SUM_FIELDS,
    ReplicaReply,
    ReplicaRound,
    Reply,
    Request,
    Round,
    Transport,
    partial_sum,
)
from flymc_dist.reduce import check_root, tree_total
from flymc_dist.replica import BrightReplica, kernel_inputs
from flymc_dist.rng import (
    ROLE_KERNEL,
    rng_state_from_json,
    rng_state_to_json,
    stream,
)
from flymc_dist.run import storage_info
from flymc_dist.streams import Z_DECIDE
from flymc_dist.tune import (
    bound_precision,
    choose_exact_rows,
    conditional_narrowing,
    find_map,
    flat_prior_to_check,
    initial_positions,
    needs_map,
    preconditioner,
)

log = logging.getLogger("flymc_dist")

#: the per-iteration statistics of every kernel, name -> dtype (ArviZ's names where ArviZ
#: has one: ``acceptance_rate`` is the kernel's acceptance probability or statistic, ``lp``
#: the log target at the new position: the log posterior up to a constant in regular
#: MCMC, FlyMC's log joint of θ and z, given the bright set); the kernel adds its own
#: (:attr:`~flymc_dist.kernels.base.Kernel.sample_stats`)
STAT_NAMES: dict[str, str] = {
    "accepted": "bool",
    "acceptance_rate": "float64",
    "n_bright": "int64",
    "likelihood_queries": "int64",
    "round_trips": "int64",
    "lp": "float64",
    "recoveries": "int64",
}


#: the MAP search starts on 1/MAP_THIN of the rows (see :func:`~flymc_dist.tune.find_map`)
#: when there are at least MAP_THIN_ROWS of them: below, a full pass costs little anyway
MAP_THIN = 16
MAP_THIN_ROWS = 2**18


class StepTally(NamedTuple):
    """What an iteration reports of its z, per chain: the bright rows (at its z-update)
    and the likelihood queries it made."""

    n_bright: np.ndarray
    queries: np.ndarray


class Driver:
    """Runs ``chains`` chains of one algorithm through a transport (:func:`~flymc_dist.run.run`
    drives it: :meth:`setup`, then :meth:`step` per iteration).

    Parameters
    ----------
    model
        The likelihood, bound and prior.
    transport
        Reaches the shards (in-process or Dask actors).
    kernel
        The θ-kernel (knows nothing of FlyMC or Dask).
    n_features
        D, the number of data columns.
    algorithm
        :class:`~flymc_dist.options.FlyMC` or :class:`~flymc_dist.options.Regular`, with
        its options (documented there). With FlyMC's ``bright_replica`` True the driver
        keeps a replica of every chain's bright rows and runs the θ-kernel on it
        (:mod:`flymc_dist.replica`); False: the shards evaluate every point the kernel
        asks for; ``"auto"``: the replica when the expected bright rows at the starting
        point (all chains) fit ``replica_budget`` bytes — for every kernel (the replica
        sums in global row order, the shards by fixed blocks along a fixed tree: either
        way the draws do not depend on the layout). In replica mode with a compiled
        model and the implicit z-update the driver updates z on its replica, fetching
        the rows the next ``read_ahead · H`` iterations propose in one request to the H
        hosts, about one message per ``read_ahead`` iterations whatever H
        (:mod:`flymc_dist.ahead`; fewer where a host's reply would pass
        :data:`~flymc_dist.ahead.REPLY_BYTES` or all of them
        :data:`~flymc_dist.ahead.BLOCK_BYTES`, none where one iteration's would); 0: a
        round to the shards every iteration. The draws are the same either way.
    chains, seed
        Number of chains; the seed of every random stream.
    n_rows
        N, the rows of the data set.
    settings
        The start: ``init`` (``"map"``: near the MAP, jittered by the Laplace
        covariance; or an array of shape ``(P,)`` or ``(chains, P)``), ``precondition``
        (the kernel's preconditioner: ``"laplace"``, the Gaussian at the MAP;
        ``"bound"``, FlyMC's Gaussian of θ given that every datum is dark, from the
        collapsed bound and the prior: :func:`~flymc_dist.tune.bound_precision`;
        ``"identity"``; or a (P, P) covariance; the starting points are jittered by the
        Laplace covariance whenever the MAP is known) and ``map_maxiter`` (iteration
        limit of the MAP search: its accuracy affects speed, never exactness). None:
        the defaults of :class:`~flymc_dist.options.RunSettings`.
    progress
        Shows each set-up pass while it runs (default: none shown).
    """

    #: per-iteration statistics of :meth:`step`, name -> dtype: :data:`STAT_NAMES` and
    #: the kernel's :attr:`~flymc_dist.kernels.base.Kernel.sample_stats`
    stat_names: dict[str, str]

    def __init__(
        self,
        model: Model,
        transport: Transport,
        kernel: Kernel,
        *,
        n_features: int,
        algorithm: FlyMC | Regular,
        chains: int,
        seed: int,
        n_rows: int,
        settings: RunSettings | None = None,
        progress: SetupProgress | None = None,
    ) -> None:
        settings = RunSettings() if settings is None else settings
        # FlyMC's options are read as its defaults when the algorithm is another
        fly = algorithm if isinstance(algorithm, FlyMC) else FlyMC()
        init, precondition = settings.init, settings.precondition
        self.model = model
        self.transport = transport
        self.kernel = kernel
        self.stat_names = {**STAT_NAMES, **kernel.sample_stats}
        self.algorithm = algorithm.name
        self.bounds = fly.bounds
        self.chains = int(chains)
        self.seed = int(seed)
        self.n_features = int(n_features)
        self.param_shape = model.param_shape(n_features)
        self.P = model.n_params(n_features)
        self.init = init
        self.precondition = precondition
        if isinstance(precondition, str) and precondition == "bound" and fly is not algorithm:
            raise ValueError("precondition='bound' needs FlyMC's bounds (algorithm='flymc')")
        self.map_maxiter = int(settings.map_maxiter)
        self.q_db = fly.q_db
        self.n_rows = int(n_rows)
        self.bound: BoundStats | None = None
        # (bound, whether its A is exactly symmetric): see BoundStats.value_and_grad
        self._bound_symmetric: tuple[BoundStats | None, bool] = (None, False)
        self.theta_map: np.ndarray | None = None
        self.map_info: dict[str, Any] = {}
        #: the expected bright rows at the MAP with bounds tight there (or None)
        self._expected_bright: float | None = None
        self.positions = np.zeros((self.chains, self.P))
        self.params: list[Any] = []
        self.commits = np.full(self.chains, -1, dtype=np.int64)
        self.rngs = [stream(self.seed, ROLE_KERNEL, c) for c in range(self.chains)]
        self.seq = 0
        self.bright_replica = fly.bright_replica
        self.replica_budget = float(fly.replica_budget)
        self.read_ahead = int(fly.read_ahead)
        self.z_update = fly.z_update
        #: replica mode, z updated here (:mod:`flymc_dist.ahead`), set up by :meth:`setup`
        self.ahead: ReadAhead | None = None
        self.exact_rows = fly.exact_rows
        self.progress = progress if progress is not None else SetupProgress(False)
        #: rows each shard evaluates at every step (``exact_rows``), per shard
        self.exact_counts: list[int] = []
        #: MAP-tuned FlyMC: how many times narrower θ | z is than the posterior, at most
        #: (:func:`~flymc_dist.tune.conditional_narrowing`), set by :meth:`setup`
        self.narrowing: float | None = None
        #: the replica of the bright rows (replica mode), set up by :meth:`setup`
        self.replica: BrightReplica | None = None
        self._replica_current: list[tuple[float, np.ndarray | None] | None] = []
        #: the iteration's strategy (:meth:`_choose_step`), chosen once per run: a
        #: function of the driver (not a bound method: no reference cycle)
        self._step_impl = Driver._step_interleaved
        self._messages_setup: dict[str, int] = {}
        self.setup_queries = 0
        self.setup_seconds = 0.0
        #: wall seconds in :meth:`step` and, within it, waiting on the transport's rounds
        self.step_seconds = 0.0
        self.round_seconds = 0.0
        #: wall seconds in :meth:`step` updating z (replica mode, :meth:`_replica_update`:
        #: the round, or here on the replica); the rest of a step is the θ-kernel's
        self.z_seconds = 0.0

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """MAP, tight points, collapsed bound, preconditioner, initial positions, initial z."""
        t0 = time.perf_counter()
        neg_h = None
        bounds_at_map = self.algorithm == "flymc" and self.bounds == "map"
        if needs_map(self.init, self.precondition, bounds_at_map) or flat_prior_to_check(
            self.model
        ):
            thin = MAP_THIN if self.n_rows >= MAP_THIN_ROWS else 1
            with self.progress.phase("MAP search") as shown:
                found = find_map(
                    self.model, self.transport, self.P, maxiter=self.map_maxiter, thin=thin
                )
                shown.rows, shown.note = map_search_rows(found, self.n_rows, thin)
            self.theta_map, neg_h, self.map_info = found.theta, found.neg_hessian, found.info
            self.setup_queries += found.passes * self.n_rows  # every datum at one θ a pass
        if self.algorithm == "flymc":
            if self.exact_rows == "auto" and self.model.exact_xi(np.zeros(1)) is not None:
                with self.progress.phase("exact rows") as shown:
                    self.exact_counts = choose_exact_rows(self.transport, self.n_rows)
                    shown.note = f"{sum(self.exact_counts):,} rows chosen"
            theta_hat = self.theta_map if bounds_at_map else None
            self.transport.call(
                "set_tight_points", None if theta_hat is None else np.asarray(theta_hat, float)
            )
            if bounds_at_map and self.model.bound_tight:
                # with every bound tight at the MAP, a row is bright there with probability
                # 1 if it is an exact row (its bound lies far below) and 0 otherwise: the
                # replica's decision needs no pass for the expected bright rows there
                self._expected_bright = float(sum(self.exact_counts))
        is_bound = isinstance(self.precondition, str) and self.precondition == "bound"
        # the start is jittered by the posterior's scale (overdispersed, for R-hat), not by
        # the narrower bounds'; only the bounds' preconditioner without a MAP needs the
        # bound statistics first, else they are summed in the pass that draws the first z
        one_pass = self.algorithm == "flymc" and not (is_bound and neg_h is None)
        if self.algorithm == "flymc" and not one_pass:
            with self.progress.phase("bound statistics", self.n_rows):
                self.bound = tree_total(self.transport.call("bound_stats"))
        if is_bound:
            jitter = (
                preconditioner("laplace", neg_h, self.P)
                if neg_h is not None
                else preconditioner("bound", None, self.P, self._bound_precision())
            )
        else:
            jitter = preconditioner(self.precondition, neg_h, self.P)
        self.positions = initial_positions(
            self.init, self.theta_map, jitter, self.chains, self.seed
        )
        if self.algorithm == "flymc" and self._use_replica():
            self.transport.call("set_replica", True)
            self.replica = BrightReplica(
                self.model, self.chains, [(s.start, s.stop) for s in self.transport.specs]
            )
        if one_pass:
            with self.progress.phase("bound statistics and first draw of z", self.n_rows):
                placed = self.transport.call("place_with_bound_stats", self.positions)
            q = [p[0] for p in placed]
            self.bound = tree_total([p[1] for p in placed])
        else:
            first = "first draw of z" if self.algorithm == "flymc" else "first evaluation"
            with self.progress.phase(first, self.n_rows):
                q = self.transport.call("set_positions", self.positions, 0)
        self.setup_queries += int(sum(q))
        forecast = bounds_at_map and neg_h is not None  # how fast FlyMC can mix
        prec = self._bound_precision() if is_bound or forecast else None
        if forecast:
            self.narrowing = conditional_narrowing(prec, neg_h)
        chol = preconditioner(self.precondition, neg_h, self.P, prec)
        self.scale_tril = chol
        self.params = [self.kernel.init_params(self.P, chol) for _ in range(self.chains)]
        if self.algorithm == "flymc":
            self.q_db = self._choose_q()
            self.transport.call("set_q", self.q_db)
        if (
            self.replica is not None
            and self.replica.fusable
            and self.z_update == "implicit"
            and self.read_ahead > 0
        ):
            # no more steps per request than every shard can hold (out of core: half its
            # memory budget; Shard.ahead_steps), nor than keep a host's reply small
            # read_ahead iterations per host: the driver's messages per iteration do not
            # grow with the hosts
            per_request = self.read_ahead * len(self.transport.hosts)
            want = min(self.transport.call("ahead_steps", per_request))
            step_bytes = self.transport.call("proposal_bytes")
            if fitting_depth(want, step_bytes, self.transport.hosts) >= 1:
                self.ahead = ReadAhead(
                    self.transport, self.replica, self.seed, self.q_db, want, step_bytes
                )
                self.ahead.take_shards_z(self.positions)
        self._choose_step()
        # the requests each host had been sent when sampling began (a Dask transport's)
        self._messages_setup = dict(getattr(self.transport, "messages", {}))
        self.setup_seconds = time.perf_counter() - t0

    def _bound_precision(self) -> np.ndarray:
        """The precision of θ given that every datum is dark (:func:`bound_precision`)."""
        return bound_precision(self.bound, self.model, self.P)

    def _use_replica(self) -> bool:
        """Whether FlyMC runs in replica mode (see ``bright_replica``)."""
        if self.bright_replica is not True and self.bright_replica != "auto":
            return False
        if self.bright_replica == "auto":
            expected = self._expected_bright
            if expected is None:  # untuned or not tight at the MAP: there (or a start)
                start = self.theta_map if self.theta_map is not None else self.positions[0]
                with self.progress.phase("expected bright rows (replica)", self.n_rows):
                    expected = float(tree_total(self.transport.call("expected_bright", start)))
                self.setup_queries += self.n_rows
            # features, target, tight point (up to K floats) and id of each row
            row_bytes = 8 * (self.n_features + 3 + self.model.n_outputs)
            # a budget of 0 holds no replica, whatever is expected
            budget = self.replica_budget
            return budget > 0 and expected * self.chains * row_bytes <= budget
        return True

    def _choose_q(self) -> float:
        """``q_db``: a number, or "auto" = k M / (N - M) from the exact initial draw of z,
        k the kernel's :attr:`~flymc_dist.kernels.base.Kernel.dark_proposals_per_bright`
        (1; HMC and NUTS 4).

        With tight bounds L~_n is tiny and a dark datum brightens at rate min(q, L~_n):
        any q above the typical L~ mixes z as well as a larger one, while costing
        q·N proposals per iteration. "auto" proposes about k dark rows per bright one and
        iteration, whatever N: q = k M / (N - M), at least 1/N
        (about one proposal per iteration, so that z keeps mixing when almost nothing is
        bright) and at most 0.1. It is chosen once before sampling and then fixed, so the
        kernel stays valid. There is no floor proportional to N: with a few bright rows
        among millions one would make the z-update cost O(N) for no gain in mixing.

        M is the chains' mean bright count in the exact initial draw z ~ p(z | θ_0), which
        the shards already hold: it needs no extra pass over the data (unlike
        ``Shard.expected_bright``, a full pass). It is a draw of a sum of independent
        Bernoullis, so its relative error is about 1/sqrt(C·M): large only when M is a
        handful, where q then lands within a few proposals per iteration of M/N, which
        the floor 1/N bounds from below.

        Measured (logistic D = 20, MAP-tuned RWMH, 4 chains, in-process): at N = 1e6 with
        ~2.8 bright rows per chain, "auto" (~2.7 proposals per iteration) against the old
        floor q = 1e-5 (10) and q = 1e-4 (100) gave min bulk ESS (4 chains) per iteration 0.034,
        0.035 and 0.037 (± 0.002; 4 seeds × 15,000 draws each) for 5.5, 12.9 and 103
        likelihood queries per iteration; at N = 4e6 (float32 store, ~2.9 bright rows),
        "auto" (~2.8 proposals) against q = 1e-5 (40) gave 0.035 and 0.034 (± 0.002) for
        5.7 and 42.9 queries per iteration. Earlier, on 2M × 57 (M/N = 3.8e-6), q = 1e-4,
        1e-5 and 3e-6 gave the same ESS per iteration too.
        """
        if not isinstance(self.q_db, str):
            return float(self.q_db)
        states = self.transport.call("state")
        m = float(np.mean(np.sum([s["n_bright"] for s in states], axis=0)))
        # exact rows are bright in every chain whatever its θ: one proposal each
        e = float(min(sum(self.exact_counts), m))
        n = max(self.n_rows, 1)
        k = float(self.kernel.dark_proposals_per_bright)
        return float(np.clip((k * (m - e) + e) / max(n - m, 1.0), 1.0 / n, 0.1))

    # ------------------------------------------------------------ the target
    def _base(self, points: np.ndarray, grad: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Prior (+ collapsed bound for FlyMC) at points (k, P)."""
        val = self.model.log_prior(points)
        g = self.model.log_prior_grad(points) if grad else None
        bound = self.bound
        if bound is not None:
            if grad:
                if self._bound_symmetric[0] is not bound:
                    self._bound_symmetric = (bound, bool(np.array_equal(bound.A, bound.A.T)))
                bval, bgrad = bound.value_and_grad(points, self._bound_symmetric[1])
                val = val + bval
                g = g + bgrad
            else:
                val = val + bound.value(points)
        return val, g

    def _respond_all(self, reqs: list[EvalRequest | None], agg: Reply) -> dict[int, EvalResponse]:
        """Responses for every chain with a pending request: the prior and the collapsed
        bound are evaluated for all chains' current positions and points in one call."""
        active = [c for c, r in enumerate(reqs) if r is not None]
        n = len(active)
        # every chain (a slice, not a copy) or the active ones
        rows = slice(None) if n == self.chains else active
        points = [reqs[c].points for c in active]
        want_grad = any(reqs[c].grad or reqs[c].current_grad for c in active)
        val, g = self._base(np.concatenate([self.positions[rows], *points]), want_grad)
        # the current positions' log targets of the active chains in one addition
        logp_current = (val[:n] + agg.current[rows]).tolist()
        agg_points = agg.points
        out = {}
        off = n
        for i, c in enumerate(active):
            req = reqs[c]
            k = points[i].shape[0]
            grad_current = g[i] + agg.current_grad[c] if req.current_grad else None
            logp = val[off : off + k] + agg_points[c, :k]
            grad = g[off : off + k] + agg.points_grad[c, :k] if (req.grad and k) else None
            off += k
            out[c] = EvalResponse(logp_current[i], grad_current, logp, grad)
        return out

    @staticmethod
    def _aggregate(replies: list[Reply]) -> Reply:
        """Sum shard replies (or relays' partial sums of them) field by field: the sums
        along the fixed block tree the shards' nodes belong to
        (:func:`~flymc_dist.protocol.partial_sum`), so the same bits whatever the layout
        and the relay tree; the counts shard by shard. A field absent (None) from the
        first reply is absent from the sum."""
        total = partial_sum(replies)
        check_root(total.tree)
        return Reply._make(
            [None if v is None else v[0] if i in SUM_FIELDS else v for i, v in enumerate(total)]
        )._replace(tree=None)

    # ------------------------------------------------------------- iteration
    def _round(self, first: bool, requests: list[Request | None], positions: np.ndarray) -> Reply:
        """One round trip to every shard; returns the summed replies. (Shard mode: in
        replica mode the iteration's one round trip is :meth:`_replica_update`.)

        Parameters
        ----------
        first
            The iteration's first round trip: commit the previous decisions, update z.
        requests
            Each chain's request (None: the chain has finished its step).
        positions
            Every chain's post-commit position (where fault recovery puts new shards).
        """
        commits = self.commits if first else np.full(self.chains, -1, dtype=np.int64)
        self.seq += 1
        t_rt = time.perf_counter()
        msg = Round(self.seq, commits, first and self.algorithm == "flymc", requests)
        replies = self.transport.round(msg, positions)
        self.round_seconds += time.perf_counter() - t_rt
        return self._aggregate(replies)

    def _replica_update(self, positions: np.ndarray) -> StepTally:
        """The iteration's z-update in replica mode: here, on the replica, from the
        proposals read ahead (:mod:`flymc_dist.ahead`), or on the shards in one round
        trip, the change applied to the replica. Returns the bright rows and the queries
        (to which the evaluations on the replica add) per chain."""
        t_z = time.perf_counter()
        try:
            return self._update_z_replica(positions)
        finally:
            self.z_seconds += time.perf_counter() - t_z

    def _update_z_replica(self, positions: np.ndarray) -> StepTally:
        """:meth:`_replica_update` (untimed)."""
        C = self.chains
        if self.ahead is not None:  # z updated here, its proposals read ahead
            waited = self.ahead.wait_seconds
            queries = self.ahead.update(positions)
            self.round_seconds += self.ahead.wait_seconds - waited
            self._replica_current = [None] * C
            return StepTally(self.replica.n_bright(), queries)
        self.seq += 1
        t_rt = time.perf_counter()
        replies: list[ReplicaReply] = self.transport.round(
            ReplicaRound(self.seq, positions), positions
        )
        self.round_seconds += time.perf_counter() - t_rt
        self.replica.apply(replies)
        queries = np.zeros(C, dtype=np.int64)
        for r in replies:  # in global shard order
            queries += r.queries
        self._replica_current = [None] * C
        return StepTally(self.replica.n_bright(), queries)

    def _replica_current_sums(
        self,
        requests: list[EvalRequest | None],
        positions: np.ndarray,
        queries: np.ndarray,
    ) -> None:
        """Bring :attr:`_replica_current` (each chain's bright sum, and its gradient
        where asked, at its current θ: it changes only with z, once per iteration) up to
        what ``requests`` need; the queries made are added to ``queries``."""
        cur_pts: list[np.ndarray | None] = [None] * self.chains
        cur_grad = [False] * self.chains
        missing = False
        for c, r in enumerate(requests):
            if r is None:
                continue
            cur_grad[c] = r.current_grad
            known = self._replica_current[c]
            if known is None or (r.current_grad and known[1] is None):
                cur_pts[c] = positions[c : c + 1]
                missing = True
        if not missing:
            return
        for c, res in enumerate(self.replica.evaluate(cur_pts, cur_grad)):
            if res is not None:
                self._replica_current[c] = (float(res[0][0]), None if res[1] is None else res[1][0])
                queries[c] += res[2]

    def _replica_respond(
        self, reqs: list[EvalRequest | None], queries: np.ndarray
    ) -> dict[int, EvalResponse]:
        """:meth:`_respond_all` in replica mode, after the iteration's round trip: the
        requests evaluated on the replica, plus the prior and the collapsed bound. The
        queries made are added to ``queries``."""
        active = [c for c, r in enumerate(reqs) if r is not None]
        n = len(active)
        positions = self.positions
        self._replica_current_sums(reqs, positions, queries)
        rows = slice(None) if n == self.chains else active
        points = [reqs[c].points for c in active]
        want_grad = [r is not None and r.grad for r in reqs]
        evals = self.replica.evaluate([None if r is None else r.points for r in reqs], want_grad)
        any_grad = any(reqs[c].grad or reqs[c].current_grad for c in active)
        val, g = self._base(np.concatenate([positions[rows], *points]), any_grad)
        out = {}
        off = n
        for i, c in enumerate(active):
            req = reqs[c]
            sums, grads, q = evals[c]
            queries[c] += q
            k = points[i].shape[0]
            known = self._replica_current[c]
            grad_current = g[i] + known[1] if req.current_grad else None
            logp = val[off : off + k] + sums
            grad = g[off : off + k] + grads if (req.grad and k) else None
            off += k
            out[c] = EvalResponse(float(val[i] + known[0]), grad_current, logp, grad)
        return out

    def _step_interleaved(self) -> tuple[list[KernelInfo], list[float], StepTally]:
        """Every chain's kernel generator, their pending requests sharing round trips.

        Returns
        -------
        infos, log_joint, tally
            Each chain's info and log target at its new position, and its bright rows
            (at the first round trip) and queries (over all of them). Sets
            :attr:`positions`.
        """
        C = self.chains
        kernel_step = self.kernel.step
        gens = [
            kernel_step(rng, position, params)
            for rng, position, params in zip(self.rngs, self.positions, self.params, strict=True)
        ]
        reqs: list[EvalRequest | None] = [next(g) for g in gens]
        pending = C  # every step yields at least one request (rule 4 of the kernel protocol)
        infos: list[KernelInfo | None] = [None] * C
        last: list[EvalResponse | None] = [None] * C
        # post-commit positions: chains that finished this iteration hold their new
        # position (also what fault recovery puts recreated shards at)
        new_positions = self.positions.copy()
        first_agg = None
        if self.replica is not None:
            # the one round trip; every request is then answered on the replica, here
            first_agg = self._replica_update(new_positions)
        while pending:
            if self.replica is not None:
                responses = self._replica_respond(reqs, first_agg.queries)
            else:
                shard_reqs = [
                    None if r is None else Request(r.points, r.grad, r.current_grad) for r in reqs
                ]
                agg = self._round(first_agg is None, shard_reqs, new_positions)
                if first_agg is None:
                    first_agg = agg
                else:
                    np.add(first_agg.queries, agg.queries, out=first_agg.queries)
                responses = self._respond_all(reqs, agg)
            for c, resp in responses.items():
                last[c] = resp
                try:
                    reqs[c] = gens[c].send(resp)
                except StopIteration as stop:
                    reqs[c] = None
                    pending -= 1
                    new_pos, info = stop.value
                    infos[c] = info
                    new_positions[c] = new_pos
        log_joint = [
            last[c].logp[info.index] if info.index >= 0 else last[c].logp_current
            for c, info in enumerate(infos)
        ]
        self.positions = new_positions
        return infos, log_joint, StepTally(first_agg.n_bright, first_agg.queries)

    def _step_chains(self) -> tuple[list[KernelInfo], np.ndarray, StepTally]:
        """Every chain at once through the kernel's ``step_chains`` (one round trip).

        The same arithmetic as :meth:`_respond_all` on the same arrays, without a
        request, a response and a generator per chain. Returns as
        :meth:`_step_interleaved`.
        """
        C = self.chains
        gen = self.kernel.step_chains(self.rngs, self.positions, self.params)
        proposals = next(gen)
        if self.replica is not None:
            tally = self._replica_update(self.positions)
            resp = self._replica_respond(
                [EvalRequest(proposals[c : c + 1]) for c in range(C)], tally.queries
            )
            logp_current = np.array([resp[c].logp_current for c in range(C)])
            logp = np.array([resp[c].logp[0] for c in range(C)])
        else:
            agg = self._round(
                True,
                [Request(proposals[c : c + 1], False, False) for c in range(C)],
                self.positions,
            )
            val, _ = self._base(np.concatenate([self.positions, proposals]), False)
            logp_current = val[:C] + agg.current
            logp = val[C:] + agg.points[:, 0]
            tally = StepTally(agg.n_bright, agg.queries)
        try:
            gen.send((logp_current, logp))
        except StopIteration as stop:
            new_positions, infos = stop.value
        else:
            raise RuntimeError(f"{self.kernel!r}.step_chains yielded more than once")
        moved = np.array([info.index >= 0 for info in infos])
        self.positions = new_positions
        return infos, np.where(moved, logp, logp_current), tally

    def _step_fused(self) -> tuple[list[KernelInfo], list[float], StepTally]:
        """Replica mode, a kernel whose steps run whole on a compiled target
        (:meth:`~flymc_dist.kernels.base.Kernel.fused_steps`): the iteration's z-update,
        then every chain's step in one compiled call on its conditional; a step whose
        parameters do not fuse (NUTS's step-size heuristic, early in warm-up) runs as
        :meth:`_step_interleaved`. Returns as :meth:`_step_interleaved`."""
        if not all(self.kernel.fuses(p) for p in self.params):
            return self._step_interleaved()
        agg = self._replica_update(self.positions)
        targets = self.replica.fused_targets(self.bound)
        self.positions, infos, log_joint = self.kernel.fused_steps(
            self.rngs, self.positions, self.params, targets
        )
        agg.queries[:] += np.array([info.n_evals for info in infos]) * targets.n_rows
        return infos, log_joint.tolist(), agg

    def _messages_sent(self) -> int:
        """Rounds sent and read-ahead requests posted so far (see :meth:`step`)."""
        return self.seq + (0 if self.ahead is None else self.ahead.requests)

    def _choose_step(self) -> None:
        """The iteration's strategy, chosen once per run (again only when the replica is
        handed back to the shards): on a replica whose model has a compiled form, the
        fused compiled step (:meth:`_step_fused`; a kernel with an all-chains step only
        when its steps fuse); else the kernel's all-chains step when it has one, else
        every chain's generator, their requests sharing round trips."""
        chains = self.kernel.step_chains is not None
        if (self.replica is not None and self.replica.fusable) and (
            not chains or self.kernel.fuses(self.params[0])
        ):
            self._step_impl = Driver._step_fused
        elif chains:
            self._step_impl = Driver._step_chains
        else:
            self._step_impl = Driver._step_interleaved

    def step(self, adapters: list[Any] | None = None) -> dict[str, np.ndarray]:
        """One iteration of every chain. Returns this iteration's stats, shape (C,).

        Its round trips are counted here, and only here: the rounds it sent (each has
        its sequence number, :attr:`seq`) and the read-ahead requests it posted
        (:attr:`ReadAhead.requests <flymc_dist.ahead.ReadAhead.requests>`); what fault
        recovery sends besides is the transport's (``recoveries``)."""
        t_step = time.perf_counter()
        C = self.chains
        recoveries = self.transport.recoveries
        n_recoveries = len(recoveries)
        sent = self._messages_sent()
        infos, log_joint, tally = self._step_impl(self)
        round_trips = self._messages_sent() - sent
        if adapters is not None:
            self.params = [a.update(info) for a, info in zip(adapters, infos, strict=True)]
        self.commits = np.array([info.index for info in infos], dtype=np.int64)
        if self.ahead is not None and self.bright_replica == "auto":
            self._check_budget()
        self.step_seconds += time.perf_counter() - t_step
        return {
            "accepted": np.array([info.accepted for info in infos], dtype=bool),
            "acceptance_rate": np.array([info.accept_prob for info in infos], dtype=float),
            "n_bright": np.asarray(tally.n_bright, dtype=np.int64),  # at the z-update
            "likelihood_queries": np.asarray(tally.queries, dtype=np.int64),
            "round_trips": np.array([round_trips] * C, dtype=np.int64),
            "lp": np.asarray(log_joint, dtype=float),
            "recoveries": np.array([len(recoveries) - n_recoveries] * C, dtype=np.int64),
            **self.kernel.info_stats(infos),
        }

    def steps(
        self, n: int, seconds: float, positions: np.ndarray, stats: dict[str, np.ndarray]
    ) -> int:
        """Up to ``n`` iterations of every chain, after warm-up (no adaptation), as many
        as end within about ``seconds`` (at least one), written into ``positions`` ``(C,
        n, P)`` and :meth:`step`'s statistics ``stats`` ``(C, n)`` (the run's own arrays:
        nothing is copied after): the same as ``k`` calls of :meth:`step`. Returns ``k``.

        In replica mode with NUTS or random-walk MH, its proposals read ahead, the
        iterations of a read-ahead block run in one compiled call
        (:meth:`~flymc_dist.replica.BrightReplica.block_steps`); the rest, and an
        iteration that call leaves to Python (a NaN for the guard to name), run
        :meth:`step` by step. ``n = 0`` runs none and makes that call ready (the runner
        asks at the end of warm-up: loading the compiled loop from numba's cache takes
        ~20 ms, once per process)."""
        t0 = time.perf_counter()
        if n == 0:  # none: the compiled loop made ready (numba loads it at its first call)
            self._block(0, positions, stats, 0, seconds)
            return 0
        i = 0
        while i < n and (i == 0 or time.perf_counter() - t0 < seconds):
            left = seconds - (time.perf_counter() - t0)
            done = self._block(n - i, positions, stats, i, left)
            if not done:
                st = self.step()
                positions[:, i] = self.positions
                for k, v in stats.items():
                    v[:, i] = st[k]
                done = 1
            i += done
        return i

    def _block(
        self, n: int, positions: np.ndarray, stats: dict[str, np.ndarray], i0: int, seconds: float
    ) -> int:
        """:meth:`steps`' compiled iterations: up to ``n`` of them, to the end of the
        read-ahead block or the first to end ``seconds`` after the call began, written at
        ``i0``. Returns how many ran (0: none could). ``n = 0`` calls the compiled loop
        for none, on the block held (nothing asked of the hosts): numba loads it then."""
        ahead, replica, kernel = self.ahead, self.replica, self.kernel
        if not (
            self._step_impl is Driver._step_fused
            and ahead is not None
            and all(kernel.fuses(p) for p in self.params)
            and replica.loops()
        ):
            return 0
        t_step = time.perf_counter()
        C = self.chains
        recoveries = self.transport.recoveries
        n_recoveries = len(recoveries)
        sent = self._messages_sent()
        waited = ahead.wait_seconds
        block = ahead.block(self.positions) if n else ahead.held
        if block is None:
            return 0
        self.round_seconds += ahead.wait_seconds - waited
        n = max(0, min(n, block.first + ahead.depth - ahead.step))
        params = self.params
        name, settings = kernel.fused_settings(params)
        inputs = kernel_inputs(replica.held, name, self.rngs, settings, self.P)
        thetas = np.array(self.positions, dtype=np.float64)  # updated in place
        theta_clock = float(replica.kernel_clock[0])
        done, over_budget, pos, floats, ints = replica.block_steps(
            n,
            block,
            (self.seed, ahead.generation, ahead.step, Z_DECIDE),
            ahead.q,
            thetas,
            name,
            inputs,
            self.bound,
            replica.max_rows(self.replica_budget) if self.bright_replica == "auto" else -1,
            seconds - (time.perf_counter() - t_step),
        )
        ahead.step += done
        if done:
            self.positions = thetas
            self.commits = np.where(ints[done - 1, :, 0] != 0, 0, -1).astype(np.int64)
            self._replica_current = [None] * C
            out = slice(i0, i0 + done)
            positions[:, out] = pos.transpose(1, 0, 2)
            info = {
                "divergent": ints[:, :, 4].T,
                "n_leapfrog": ints[:, :, 1].T,
                "step_size": np.array([p.step_size for p in params])[:, None],
                "energy": floats[:, :, 1].T,
                "tree_depth": ints[:, :, 3].T,
            }
            values = {
                "accepted": ints[:, :, 0].T,
                "acceptance_rate": floats[:, :, 2].T,
                "n_bright": ints[:, :, 5].T,
                "likelihood_queries": ints[:, :, 6].T,
                "round_trips": 0,
                "lp": floats[:, :, 0].T,
                "recoveries": 0,
                **{k: info[INFO_ATTRIBUTES[k]] for k in kernel.sample_stats},
            }
            for k, v in stats.items():
                v[:, out] = values[k]
            # the block's request, and any recovery, in the first iteration (as step)
            stats["round_trips"][:, i0] = self._messages_sent() - sent
            stats["recoveries"][:, i0] = len(recoveries) - n_recoveries
        wall = time.perf_counter() - t_step
        self.z_seconds += wall - (float(replica.kernel_clock[0]) - theta_clock)
        self.step_seconds += wall
        if over_budget:
            self._check_budget()
        return done

    def _check_budget(self) -> None:
        """``bright_replica="auto"``: once the replica outgrows ``replica_budget``, hand z
        back to the shards (:meth:`ReadAhead.hand_back`) and go on with shard-evaluated
        rounds (their sums, added shard by shard). The chains stay exact: the shards
        continue z from the driver's state, with the streams the driver would have used."""
        if self.replica.nbytes() <= self.replica_budget:
            return
        log.warning(
            "the bright rows (%d per chain, %.0f MB) outgrew replica_budget (%.0f MB): "
            "the shards evaluate the sums from here on",
            int(self.replica.n_bright().mean()),
            self.replica.nbytes() / 1e6,
            self.replica_budget / 1e6,
        )
        self.transport.call("set_replica", False)  # first: gradients are kept from here
        self.ahead.hand_back(self.positions)
        self.ahead = None
        self.replica = None
        self._choose_step()
        self.commits = np.full(self.chains, -1, dtype=np.int64)

    def checkpoint(self, iteration: int) -> dict[str, Any]:
        """A JSON-able snapshot to resume from (positions, params, kernel RNG states)."""
        return {
            "iteration": int(iteration),
            "positions": self.positions.tolist(),
            "params": [params_to_json(p) for p in self.params],
            "rng_states": [rng_state_to_json(r.bit_generator.state) for r in self.rngs],
            "seq": int(self.seq),
            # the random-stream generation of the shards' z: resume starts the next one
            "generation": int(self.transport.generation),
        }

    # ------------------------------------------------- what the runner (run.py) reads
    def restore(self, checkpoint: dict[str, Any]) -> None:
        """Continue from a :meth:`checkpoint`: positions, kernel parameters and streams,
        then a fresh exact draw of z at the positions (a valid Gibbs step) from streams of
        a generation no earlier segment used: the one counter that fault recovery also
        advances, kept in every checkpoint. Call after :meth:`setup`."""
        self.positions = np.asarray(checkpoint["positions"], float)
        kind = type(self.params[0])
        self.params = [params_from_json(kind, p) for p in checkpoint["params"]]
        for r, s in zip(self.rngs, checkpoint["rng_states"], strict=True):
            r.bit_generator.state = rng_state_from_json(s)
        self.seq = int(checkpoint["seq"])
        self.transport.generation = int(checkpoint["generation"]) + 1
        self.transport.call("set_positions", self.positions, self.transport.generation)
        if self.ahead is not None:
            self.ahead.take_shards_z(self.positions)

    def setup_info(self) -> dict[str, Any]:
        """The run information :meth:`setup` settled (``q_db``, MAP, set-up cost, each
        shard's mode: in memory or out of core, with what budget; the full passes over the
        data it took, ``setup_passes``)."""
        storage = storage_info(self.transport)
        setup_bytes_read = storage.pop("bytes_read")
        setup_passes = storage.pop("passes")
        storage.pop("rows_read")
        storage.pop("lost_rows")
        return {
            **storage,
            "q_db": self.q_db if self.algorithm == "flymc" else None,
            "exact_rows": (
                sum(self.exact_counts)
                if self.algorithm == "flymc" and self.exact_rows is not None
                else None
            ),
            "conditional_narrowing": self.narrowing,
            "gibbs_ess_per_draw": (
                None if self.narrowing is None else 1.0 / max(2.0 * self.narrowing - 1.0, 1.0)
            ),
            "map": None if self.theta_map is None else self.theta_map.reshape(self.param_shape),
            "map_info": self.map_info,
            "setup_queries": self.setup_queries,
            "setup_seconds": self.setup_seconds,
            "setup_bytes_read": setup_bytes_read,
            "setup_passes": setup_passes,
        }

    def timing(self) -> dict[str, Any]:
        """Cumulative seconds so far: in :meth:`step`, waiting on rounds, updating z
        (replica mode), and per host."""
        return {
            "step": self.step_seconds,
            "round": self.round_seconds,
            "z": self.z_seconds,
            "theta": None if self.replica is None else float(self.replica.kernel_clock[0]),
            "hosts": self.transport.timing(),
        }

    def run_info(self, stats: dict[str, np.ndarray]) -> dict[str, Any]:
        """How the run went (modes taken, data read, requests sent to each host while
        sampling: ``host_messages``, a Dask transport's), for ``Result.info``."""
        sent = getattr(self.transport, "messages", None)
        host_messages = (
            None
            if sent is None
            else {w: n - self._messages_setup.get(w, 0) for w, n in sorted(sent.items())}
        )
        storage = storage_info(self.transport)
        return {
            "bright_replica": self.replica is not None,
            "read_ahead": self.ahead.depth if self.ahead is not None else 0,
            "host_messages": host_messages,
            "channel": self.transport.channel,
            "local_channels": getattr(self.transport, "local_hosts", 0),
            "lending_hosts": self.transport.lending_hosts,
            "bytes_read": storage["bytes_read"],
            "rows_read": storage["rows_read"],
            "lost_rows": storage["lost_rows"],
        }
