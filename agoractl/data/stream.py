"""The streaming reader: packed training sequences from a trainer's shards (report §3.3.2.1).

A shard is read document by document in its stored (pre-shuffled) order; each document becomes
``encode(text) + [eos]`` and the concatenation is cut into non-overlapping sequences of
``seq_len + 1`` tokens (inputs and shifted labels). The tail of a shard shorter than that is left
unread, which is exactly the ledger's definition of an exhausted shard. A trainer reads its holdings
one after the other; when all are exhausted it claims the next ones from the shard ledger in the store
(:mod:`agoractl.data.claim_source`, :mod:`agoractl.data.claims`: the next unclaimed shards of the
epoch, a dead trainer's shard once its lease expired, or the next epoch once every shard of this one is
done, up to ``data.epochs``) and continues, or ends when the data is exhausted. Every sequence handed
out is in flight until the trainer settles it; the claims record what is completed.

Resumption is exact: a position records, per holding, the tokens consumed and, for the holding being
read, the document and token where the next sequence starts, so a resumed reader yields exactly the
sequences an uninterrupted one would.

``run_sequences`` is the whole run's stream for the centralized reference: trainers 0..count-1
interleaved round-robin, each over the initial assignment, rotating in memory as they exhaust.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional, Protocol

import numpy as np
import pyarrow.parquet as pq
import torch

from agoractl import logs, storage
from agoractl.data import remote
from agoractl.data.index import ShardIndex, read_index
from agoractl.data.ledger import Holding, Ledger, fold_reports, initial_ledger, rotate, write_progress
from agoractl.data.tokenizers import Tokenizer, load_tokenizer
from agoractl.errors import RuntimeFailure
from agoractl.manifest.schema import Run


class LedgerSource(Protocol):
    """Where a trainer's assignment comes from, and where its consumption goes."""

    def assignment(self, trainer: int) -> Optional[list[Holding]]: ...

    def report(self, trainer: int, holdings: list[Holding], position: Any) -> None: ...


class LedgerMemory:
    """An in-memory ledger that rotates a trainer as soon as it reports exhaustion (central reference)."""

    def __init__(self, ledger: Ledger, index: ShardIndex, trainers: int, wrap: bool = False):
        self.ledger, self.index, self.trainers, self.wrap = ledger, index, trainers, wrap

    def assignment(self, trainer: int) -> Optional[list[Holding]]:
        t = self.ledger.trainer(trainer)
        return None if t is None else [Holding(**{**h.__dict__, "skip": list(h.skip)}) for h in t.holdings]

    def report(self, trainer: int, holdings: list[Holding], position: Any) -> None:
        fold_reports(self.ledger, [{"trainer": trainer, "holdings": [h.__dict__ for h in holdings]}])
        rotate(self.ledger, self.index, self.trainers, wrap=self.wrap, only={trainer})


def check_tokenizer(index: ShardIndex, tok: Tokenizer, output: str) -> None:
    """The index's token counts hold only under the tokenizer it was made with."""
    have, want = tok.describe(), index.tokenizer
    if {k: have.get(k) for k in ("kind", "vocab_size", "eos_id", "sha256")} != \
            {k: want.get(k) for k in ("kind", "vocab_size", "eos_id", "sha256")}:
        raise RuntimeFailure(f"{output}/index.json was made with tokenizer {want.get('kind')} "
                             f"(vocab {want.get('vocab_size')}); the manifest's is {have['kind']} "
                             f"(vocab {have['vocab_size']})", hint="rerun `agoractl shard FILE` with this manifest")


class TrainerStream:
    """Packed ``seq_len + 1`` token sequences (torch.LongTensor) over one trainer's holdings."""

    def __init__(self, run: Run, trainer_index: int, position: Optional[dict[str, Any]] = None, *,
                 index: Optional[ShardIndex] = None, source: Optional[LedgerSource] = None,
                 tokenizer: Optional[Tokenizer] = None, wait_s: float = 0.0, poll_s: float = 1.0,
                 interrupt: Optional[Callable[[], bool]] = None):
        self.run, self.trainer = run, trainer_index
        self.output = run.data.output
        self.index = index or read_index(self.output)
        self.tok = tokenizer or load_tokenizer(run)
        check_tokenizer(self.index, self.tok, self.output)
        if source is None:
            from agoractl.data.claim_source import ClaimSource

            source = ClaimSource(run, self.index, trainer_index)
        self.source: LedgerSource = source
        self.claims = source if hasattr(source, "settle") else None
        """The claim ledger's source (in-flight bookkeeping), or None (an in-memory or file ledger)."""
        self.seq_len = run.model.seq_len
        self.wait_s, self.poll_s = wait_s, poll_s
        self.interrupt: Callable[[], bool] = interrupt or (lambda: False)
        """Set by the trainer: stop waiting for the epoch's last shards (the run ended meanwhile, or a signal)."""
        self.last: Optional[tuple[int, int, int]] = None
        """(shard, epoch, offset) of the sequence handed out last."""
        self.text_column = self.index.text_column
        self.current = 0
        self.row: Optional[int] = None
        self.token = 0
        adopted = None
        if position is not None and self.claims is not None:
            adopted = self.claims.adopt([Holding(**h) for h in position["holdings"]])
        holdings = adopted if adopted is not None else self._first_assignment()
        if holdings is None and self.interrupt():
            holdings = []  # stopped while waiting for a first shard: nothing to read
        elif holdings is None:
            raise RuntimeFailure(f"trainer {trainer_index} has no shard left in {self.output}",
                                 hint="every epoch of the data is read (data.epochs); `agoractl rotate-shards FILE "
                                      "--wrap` allows one more")
        self.holdings: list[Holding] = holdings
        if position is not None:
            self._restore(position)
        self._gen: Optional[Iterator[torch.Tensor]] = None

    def _first_assignment(self) -> Optional[list[Holding]]:
        got = self.source.assignment(self.trainer)
        if got == [] and self.claims is not None:  # the epoch's last shards are held by others
            logs.get("data").warning(
                "waiting for a shard: other trainers hold every shard of this epoch (trainers.shards_per_trainer "
                "each); this trainer starts when the epoch ends", trainer=self.trainer)
            return self._await_assignment()
        return got

    # -- position -------------------------------------------------------------------------------

    def position(self) -> dict[str, Any]:
        """A JSON-able resume point: the holdings with consumption, and where the next sequence starts."""
        return {"trainer": self.trainer, "holdings": [dict(h.__dict__) for h in self.holdings],
                "current": self.current, "row": self.row, "token": self.token}

    def settle(self, shard: int, epoch: int, offset: int) -> None:
        """The sequence at `offset` of (shard, epoch) completed (or was given up): not to be read again."""
        if self.claims is not None:
            self.claims.settle((shard, epoch), offset)

    def flush(self) -> None:
        """Write what is completed to the claim ledger (and renew the claims' leases)."""
        if self.claims is not None:
            self.claims.flush()

    def tokens_consumed(self) -> dict[int, int]:
        """Tokens consumed so far per shard of the current assignment."""
        return {h.shard: h.consumed for h in self.holdings}

    def _restore(self, pos: dict[str, Any]) -> None:
        saved = [Holding(**h) for h in pos["holdings"]]
        saved = [Holding(**{**h.__dict__, "skip": list(h.skip)}) for h in saved]
        if [h.key() for h in saved] != [h.key() for h in self.holdings]:
            # The ledger moved on (the trainer was rotated after the save): follow the ledger, whose
            # consumption counts are where reading resumes.
            return
        for mine, h in zip(self.holdings, saved):  # in place: the claim source tracks these objects
            mine.consumed, mine.skip = h.consumed, list(h.skip)
        self.current, self.row, self.token = int(pos["current"]), pos["row"], int(pos["token"])

    # -- iteration ------------------------------------------------------------------------------

    def __iter__(self) -> "TrainerStream":
        return self

    def __next__(self) -> torch.Tensor:
        if self._gen is None:
            self._gen = self._sequences()
        return next(self._gen)

    def _sequences(self) -> Iterator[torch.Tensor]:
        while True:
            while self.current < len(self.holdings):
                h = self.holdings[self.current]
                if not h.exhausted(self.seq_len):
                    yield from self._read_holding(h)
                self.current += 1
                self.row, self.token = None, 0
            self.source.report(self.trainer, self.holdings, self.position())
            new = self._await_assignment()
            if new is None:
                return
            self.holdings, self.current, self.row, self.token = new, 0, None, 0

    def _await_assignment(self) -> Optional[list[Holding]]:
        """A new, not yet exhausted assignment from the ledger, polling up to wait_s seconds (claims: for as
        long as other trainers hold the epoch's last shards, unless :attr:`interrupt` says stop)."""
        if self.claims is not None:
            while True:
                self.claims.flush()
                new = self.source.assignment(self.trainer)
                if new is None or new or self.interrupt():
                    return new or None
                time.sleep(self.poll_s)
        deadline = time.monotonic() + self.wait_s
        old = [h.key() for h in getattr(self, "holdings", [])]
        while True:
            new = self.source.assignment(self.trainer)
            if not new:  # no entry, or rotation left it nothing: the corpus is used up for this trainer
                return None
            if [h.key() for h in new] != old and not all(h.exhausted(self.seq_len) for h in new):
                return new
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.poll_s)

    def _read_holding(self, h: Holding) -> Iterator[torch.Tensor]:
        L1 = self.seq_len + 1
        url = self.index.shard_url(self.output, h.shard)
        if self.row is None:
            self.row, self.token = self._locate(url, h.consumed)
        start_row, start_tok = self.row, self.token
        skip = set(h.skip)
        pending: list[list[Any]] = []  # [row, first token, tokens]: what is read but not yet yielded
        have = 0
        last_row = start_row - 1
        for r, text in self._documents(url, start_row):
            arr = np.append(self.tok.encode_array(text), self.tok.eos_id)
            first = start_tok if r == start_row else 0
            if first:
                arr = arr[first:]
            pending.append([r, first, arr])
            have += len(arr)
            last_row = r
            while have >= L1:
                parts, need = [], L1
                while need:
                    head = pending[0]
                    take = min(need, len(head[2]))
                    parts.append(head[2][:take])
                    need -= take
                    if take == len(head[2]):
                        pending.pop(0)
                    else:
                        head[1] += take
                        head[2] = head[2][take:]
                have -= L1
                offset = h.consumed
                h.consumed += L1
                self.row, self.token = (pending[0][0], pending[0][1]) if pending else (last_row + 1, 0)
                if offset in skip:  # completed by the shard's previous reader beyond its first unfinished one
                    continue
                if self.claims is not None:
                    if self.claims.is_lost(h.key()):
                        return  # another trainer took the shard over (our lease lapsed): it reads on
                    self.claims.issue(h.key(), offset)
                self.last = (h.shard, h.epoch, offset)
                yield torch.from_numpy(np.concatenate(parts).astype(np.int64))
        if have != h.tokens - h.consumed:
            raise RuntimeFailure(f"{url}: holds {h.consumed + have} tokens but the index says {h.tokens}",
                                 hint="the shard or the tokenizer changed; rerun `agoractl shard FILE`")
        h.consumed = h.tokens - have  # the unread tail is shorter than one sequence: exhausted

    def _documents(self, url: str, start_row: int) -> Iterator[tuple[int, str]]:
        """(row, text) from `start_row` on, one row group in memory at a time."""
        fs, path = remote.filesystem(url)
        try:
            f = fs.open(path, "rb")
            pf = pq.ParquetFile(f)
        except Exception as e:
            raise RuntimeFailure(storage.describe_error(url, e), hint="rerun `agoractl shard FILE`")
        with f:
            base = 0
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if base + n <= start_row:
                    base += n
                    continue
                texts = pf.read_row_group(g, columns=[self.text_column]).column(0).to_pylist()
                for j in range(max(0, start_row - base), n):
                    yield base + j, texts[j]
                base += n

    def _locate(self, url: str, consumed: int) -> tuple[int, int]:
        """The (row, token) where the `consumed`-th token of a shard lies."""
        if consumed == 0:
            return 0, 0
        fs, path = remote.filesystem(url)
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            base_row, base_tok = 0, 0
            for g in range(pf.metadata.num_row_groups):
                texts = pf.read_row_group(g, columns=[self.text_column]).column(0)
                lengths = self.tok.lengths_arrow(texts) + 1
                total = int(lengths.sum())
                if base_tok + total > consumed:
                    ends = base_tok + np.cumsum(lengths)
                    j = int(np.searchsorted(ends, consumed, side="right"))  # document holding the token
                    start = int(ends[j - 1]) if j else base_tok
                    return base_row + j, consumed - start
                base_row += len(lengths)
                base_tok += total
        return base_row, 0


def trainer_stream(run: Run, trainer_index: int, position: Optional[dict[str, Any]] = None,
                   wait_s: float = 0.0, poll_s: float = 1.0,
                   interrupt: Optional[Callable[[], bool]] = None) -> TrainerStream:
    """The stream of trainer `trainer_index` over the shards the ledger assigns it.

    Creates the initial ledger when missing. `position` (from ``.position()``) resumes exactly. When
    its shards are exhausted the stream reports, then waits up to `wait_s` seconds for rotation to
    assign new ones before it ends.
    """
    return TrainerStream(run, trainer_index, position, wait_s=wait_s, poll_s=poll_s, interrupt=interrupt)


def report_progress(run: Run, trainer_index: int, stream: TrainerStream) -> str:
    """Write the trainer's consumption to ``<data.output>/progress/trainer-NNNNN.json`` (atomically), and
    renew its claims' leases."""
    stream.flush()
    return write_progress(run.data.output, trainer_index, stream.holdings, stream.position())


def run_sequences(run: Run, wrap: bool = False) -> Iterator[torch.Tensor]:
    """The whole run's sequences for the centralized reference: trainers interleaved round-robin.

    Deterministic: built from the index and the initial assignment (never from the shared ledger's
    live state), so a central run sees the samples the swarm's trainers start from.
    """
    index = read_index(run.data.output)
    tok = load_tokenizer(run)
    count = run.trainers.count
    ledger = initial_ledger(index, count, run.trainers.shards_per_trainer, run.model.seq_len, run.data.seed)
    source = LedgerMemory(ledger, index, count, wrap=wrap)
    streams = [TrainerStream(run, i, index=index, source=source, tokenizer=tok) for i in range(count)]
    while streams:
        alive = []
        for s in streams:
            try:
                yield next(s)
                alive.append(s)
            except StopIteration:
                pass
        streams = alive
