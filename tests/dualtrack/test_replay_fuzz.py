"""Property-based: any record lines, any records folder, any leftovers in --out. `dualtrack replay`
and `dualtrack report` (in-process, real promtool and matplotlib) exit with a code and at most one
line on stderr, within a time bound, and touch nothing outside --out. Any answer a Prometheus (or
what pretends to be one) sends on the wire: the client gives series or its one-line error, and
`dualtrack explain` exits with one line at most."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dualtrack import prometheus
from dualtrack.cli import main
from dualtrack.records import CLOCK_SLACK_SECONDS
from tests.support import hostile_http
from trainer_hook.connection import resolve

NOW = time.time()
#: No example may take longer (a hang fails the test instead of stalling the suite).
BOUND_SECONDS = 90
#: Examples per run: few in the default suite; DUALTRACK_FUZZ_EXAMPLES=500 for a deep search.
EXAMPLES = int(os.environ.get("DUALTRACK_FUZZ_EXAMPLES", "20"))

hostile_text = st.one_of(st.text(max_size=12), st.sampled_from(
    ["$x$", "$\\frac{", "a\ud800b", "\udfff", "team/a", "../..", "/etc", "", "\n\"\\", "\x00", "%s{}"]))
numbers = st.one_of(
    st.integers(), st.floats(), st.sampled_from([4102444800, 1e15, 1e300, -1e300, 10 ** 30, 10 ** 4000, -1, 0]),
    st.sampled_from(["nan", "inf", "-inf", "1", None, True, [], {}]))
times = st.one_of(st.floats(NOW - 900, NOW), st.floats(NOW - 900, NOW), numbers)
scalars = st.one_of(numbers, hostile_text)
start_lines = st.fixed_dictionaries(
    {"event": st.just("start"), "job": hostile_text, "run": hostile_text, "rank": st.one_of(st.integers(0, 3), scalars),
     "time": st.one_of(st.floats(NOW - 1000, NOW - 900), numbers)},
    optional={"format": st.one_of(st.integers(), scalars), "instance": scalars, "continued": st.booleans(),
              "config": st.one_of(st.dictionaries(hostile_text, scalars, max_size=3), scalars),
              "world_size": scalars, "local_rank": scalars, "pid": scalars})
step_lines = st.fixed_dictionaries(
    {"time": times, "step": st.one_of(st.integers(0, 100), st.integers(), numbers)},
    optional={"values": st.one_of(st.dictionaries(st.one_of(st.sampled_from(["loss", "grad_norm", "learning_rate"]),
                                                           hostile_text), scalars, max_size=4), scalars),
              "batch_id": scalars, "samples": scalars, "tokens": scalars, "duration_seconds": scalars,
              "data_wait_seconds": scalars, "nonfinite": st.one_of(st.lists(hostile_text, max_size=2), scalars),
              "skipped": st.one_of(st.just("overflow"), scalars), "loss_scale": scalars,
              "cuda": st.one_of(st.dictionaries(st.sampled_from(["allocated", "reserved"]), scalars), scalars)})
end_lines = st.fixed_dictionaries(
    {"event": st.just("end"), "time": times},
    optional={"state": st.one_of(st.sampled_from(["finished", "failed"]), scalars), "reason": scalars,
              "message": scalars, "steps": scalars})
raw_lines = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
    st.sampled_from([b"[" * 100_000, b"{" * 5000, b'{"a": "\\ud800"}', b"NaN", b"null", b"[]",
                     b'{"time": NaN, "step": 1}', b'{"time": 1e999, "step": 1}', b"\xed\xa0\x80"]))
lines = st.one_of(start_lines.map(json.dumps), step_lines.map(json.dumps), end_lines.map(json.dumps),
                  raw_lines.map(lambda b: b.decode("latin-1")))
#: Well-formed steps with hostile content, so that most examples get as far as promtool and matplotlib.
good_steps = st.fixed_dictionaries(
    {"time": st.floats(NOW - 900, NOW), "step": st.integers(0, 10 ** 6),
     "values": st.dictionaries(st.one_of(st.sampled_from(["loss", "grad_norm", "learning_rate"]), hostile_text),
                               scalars, max_size=4)},
    optional={"batch_id": scalars, "duration_seconds": scalars, "data_wait_seconds": scalars,
              "nonfinite": st.lists(hostile_text, max_size=2), "skipped": st.just("overflow")})
record = st.tuples(start_lines, st.lists(st.one_of(good_steps, step_lines).map(json.dumps) | lines,
                                         min_size=1, max_size=12)).map(
    lambda parts: [json.dumps(parts[0])] + parts[1])
folder_extras = st.sets(st.sampled_from(["fifo", "dev-zero", "directory", "dangling", "empty"]))
out_extras = st.sets(st.sampled_from(["escaping-manifest", "legacy-manifest", "foreign-block", "garbage-manifest",
                                      "temp-of-pid-1", "temp-garbage-owner", "temp-dead-owner"]))


class Hang(BaseException):
    """An example ran past BOUND_SECONDS."""


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    def hang(_signum: int, _frame: object) -> None:
        raise Hang(f"ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def snapshot(root: Path, skip: Path) -> dict[str, tuple]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == skip.parent:
            dirnames[:] = [d for d in dirnames if d != skip.name]
        for name in [*dirnames, *filenames]:
            info = os.lstat(os.path.join(dirpath, name))
            found[os.path.join(dirpath, name)] = (info.st_mode, info.st_size, info.st_mtime_ns, info.st_ino)
    return found


def make_folder(root: Path, records: list[list[str]], extras: set[str]) -> Path:
    folder = root / "records"
    folder.mkdir()
    for number, lines_ in enumerate(records):
        (folder / f"r{number}.jsonl").write_text("\n".join(lines_) + "\n", encoding="utf-8", errors="surrogatepass")
    if "fifo" in extras:
        os.mkfifo(folder / "pipe.jsonl")
    if "dev-zero" in extras:
        (folder / "zero.jsonl").symlink_to("/dev/zero")
    if "directory" in extras:
        (folder / "dir.jsonl").mkdir()
    if "dangling" in extras:
        (folder / "gone.jsonl").symlink_to(root / "nowhere")
    if "empty" in extras:
        (folder / "empty.jsonl").write_text("")
    return folder


def make_out(root: Path, extras: set[str]) -> Path:
    out = root / "out"
    out.mkdir()
    victim = root / "victim"
    (victim / "01ARZ3NDEKTSV4RRFFQ69G5FAV").mkdir(parents=True)
    (victim / "01ARZ3NDEKTSV4RRFFQ69G5FAV" / "meta.json").write_text("{}")
    foreign = out / "01BX5ZZKBKACTAV9WEVGEMMVRZ"
    if "foreign-block" in extras:
        foreign.mkdir()
        (foreign / "meta.json").write_text("{}")
    names = ["../victim", str(victim), "..", foreign.name, "../victim/01ARZ3NDEKTSV4RRFFQ69G5FAV"]
    if "escaping-manifest" in extras:
        entry = {"meta_sha256": "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", "runs": []}
        (out / "dualtrack-replay.json").write_text(json.dumps({"format": 2, "blocks": dict.fromkeys(names, entry)}))
    elif "legacy-manifest" in extras:
        (out / "dualtrack-replay.json").write_text(json.dumps({n: [] for n in names}))
    elif "garbage-manifest" in extras:
        (out / "dualtrack-replay.json").write_text("[" * 100_000)
    for kind, owner in (("temp-of-pid-1", {"pid": 1, "host": os.uname().nodename}),
                        ("temp-garbage-owner", "[[[["), ("temp-dead-owner", {"pid": -5})):
        if kind in extras:
            (out / f".dualtrack-replay-{kind}").mkdir()
            (out / f".dualtrack-replay-{kind}" / "dualtrack-replay-owner.json").write_text(json.dumps(owner))
    return out


def said_at_most_one_line(code: int, err: str) -> bool:
    """A failure is its one-line error alone; a run that worked says at most one line besides the
    line per run launched more than once (which launch it read, and the others)."""
    lines = err.splitlines()
    return len(lines) <= 1 if code else sum("other launches: " not in line for line in lines) <= 1


def run_cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(records=st.lists(record, min_size=1, max_size=3), folder=folder_extras, leftovers=out_extras)
# Found by this test: steps without values, so the top time axis spanned none of the clock.
@example(records=[[json.dumps({"event": "start", "job": "", "run": "", "rank": 0, "time": NOW - 200}),
                   json.dumps({"time": NOW - 100, "step": 1}), json.dumps({"time": NOW - 99, "step": 2})]],
         folder=set(), leftovers=set())
# Found by this test: two launches of a run with no step said which launch they read, then failed.
@example(records=[[json.dumps({"event": "start", "job": "", "run": "", "rank": 0, "time": NOW}),
                   json.dumps({"event": "start", "job": "", "run": "", "rank": 1, "time": NOW - 1.5})]],
         folder=set(), leftovers=set())
def test_replay_and_report_never_crash_hang_or_touch_anything_outside_out(records, folder, leftovers) -> None:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as temporary:
        root = Path(temporary)
        source = make_folder(root, records, folder)
        out = make_out(root, leftovers)
        before = snapshot(root, out)
        with bounded(BOUND_SECONDS), warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning printed on stderr is a second line
            code, err = run_cli(["replay", str(source), "--out", str(out)])
            assert code in (0, 1, 2) and said_at_most_one_line(code, err), err
            assert all(line.startswith("dualtrack replay: ") for line in err.splitlines()), err
            if code == 0:
                for meta in out.glob("*/meta.json"):
                    if meta.parent.name != "01BX5ZZKBKACTAV9WEVGEMMVRZ":
                        assert json.loads(meta.read_text())["maxTime"] <= (time.time() + CLOCK_SLACK_SECONDS) * 1000
            code, err = run_cli(["report", str(source), "--out", str(out / "report.html"), "--png"])
            assert code in (0, 1, 2) and said_at_most_one_line(code, err), err
            assert all(line.startswith("dualtrack report: ") for line in err.splitlines()), err
        assert snapshot(root, out) == before
        if "foreign-block" in leftovers:
            assert (out / "01BX5ZZKBKACTAV9WEVGEMMVRZ" / "meta.json").read_text() == "{}"
        for kind in ("temp-of-pid-1", "temp-garbage-owner", "temp-dead-owner"):
            assert (out / f".dualtrack-replay-{kind}").is_dir() == (kind in leftovers)


#: Output bytes per record byte no record passes (a step line dense with one-character keys, 256-character
#: identity labels: ~500), plus the slow series of each run's first refresh and end, which are free.
WORST_RATIO = 600
long_text = st.one_of(hostile_text, st.text(min_size=200, max_size=600), st.just("x" * 5000))
dense_steps = st.fixed_dictionaries(
    {"time": st.floats(NOW - 900, NOW), "step": st.integers(0, 10 ** 6),
     "values": st.dictionaries(st.one_of(st.text(max_size=3), st.text(min_size=250, max_size=300)),
                               st.sampled_from([1.0, "nan", 0.5]), max_size=40)})


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(head=st.fixed_dictionaries({"event": st.just("start"), "job": long_text, "run": long_text,
                                   "rank": long_text, "instance": long_text, "time": st.just(NOW - 1000),
                                   "config": st.dictionaries(long_text, long_text, max_size=20)}),
       steps=st.lists(dense_steps, min_size=1, max_size=60))
def test_replay_output_is_linear_in_the_record_and_its_labels_capped(head, steps) -> None:
    """In-process (no promtool): the OpenMetrics text of any record stays within WORST_RATIO bytes per
    record byte (plus a run's free slow series), and no label value passes the hook's cap."""
    from dualtrack.records import Reader
    from dualtrack.replay import write_openmetrics
    from tests.support.records import LABEL, Counter, unescaped
    from trainer_hook.contract import MAX_LABEL_LENGTH

    with tempfile.TemporaryDirectory(prefix="fuzz-") as temporary:
        path = Path(temporary) / "r.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in [head, *steps]), encoding="utf-8",
                        errors="surrogatepass")
        counter = Counter(keep=10 ** 6)
        runs = write_openmetrics(Reader([path]), counter)
        free = 2 * 40 * 8 * (MAX_LABEL_LENGTH + 16) + 2 * 256 * 2 * (MAX_LABEL_LENGTH + 8)  # slow series twice
        assert counter.bytes <= WORST_RATIO * path.stat().st_size + len(runs) * free
        for text in counter.kept:
            for _, value in LABEL.findall(text):
                assert len(unescaped(value)) <= MAX_LABEL_LENGTH, value


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), hostile_text),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(hostile_text, children, max_size=3),
    max_leaves=8)
samples = st.one_of(st.tuples(numbers, st.one_of(numbers.map(str), numbers)).map(list), json_values)
series = st.fixed_dictionaries(
    {"metric": st.one_of(st.dictionaries(st.sampled_from(["job", "rank", "uuid", "pid", "__name__"]) | hostile_text,
                                         hostile_text, max_size=3), json_values)},
    optional={"value": samples, "values": st.one_of(st.lists(samples, max_size=3), json_values)})
answers = st.one_of(
    st.builds(lambda status, result: json.dumps({"status": status, "data": {"resultType": "vector", "result": result}}),
              st.sampled_from(["success", "error"]), st.one_of(st.lists(series, max_size=3), json_values)),
    json_values.map(json.dumps),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
    st.sampled_from(["[" * 100_000, '{"data": []}', '{"data": {"result": "x"}}', '{"data": {"result": [[]]}}']))
#: How the answer goes on the wire (tests/support/hostile_http.py has the worst of each kind).
framings = st.sampled_from(["length", "short", "cut", "close", "chunked", "bad-chunked", "as-status-line",
                            "no-answer", "many-headers"])


def wire(status: int, body: bytes, framing: str) -> bytes:
    line = f"HTTP/1.1 {status} X\r\n".encode()
    if framing == "short":  # promises more than it sends, then closes
        return line + f"Content-Length: {len(body) + 10}\r\n\r\n".encode() + body
    if framing == "cut":  # promises less than the answer
        return line + f"Content-Length: {len(body) // 2}\r\n\r\n".encode() + body
    if framing == "close":
        return line + b"Connection: close\r\n\r\n" + body
    if framing == "chunked":
        return line + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    if framing == "bad-chunked":
        return line + b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n" + body
    if framing == "as-status-line":
        return body + b"\r\n\r\n"
    if framing == "no-answer":
        return b""
    if framing == "many-headers":
        return line + b"X: y\r\n" * 150 + b"\r\n" + body
    return hostile_http.response(status, body)


@settings(max_examples=EXAMPLES * 2, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(status=st.one_of(st.sampled_from([200, 204, 301, 400, 401, 422, 500, 503]), st.integers(0, 1000)),
       answer=answers, framing=framings)
def test_the_prometheus_client_gives_a_result_or_one_line_whatever_the_answer(status, answer, framing) -> None:
    body = wire(status, answer.encode("utf-8", "surrogatepass"), framing)
    with hostile_http.RawServer(lambda connection, _stop: connection.sendall(body)) as server, \
            bounded(BOUND_SECONDS):
        client = prometheus.Prometheus(resolve("prometheus", prometheus.ENV_URL, server.url), timeout=5)
        for ask in (lambda: client.query("up", 1e9), lambda: client.query_range("up", 1e9, 1e9 + 60, 15)):
            try:
                found = ask()
            except prometheus.QueryError as exc:
                assert str(exc) and "\n" not in str(exc), exc
            else:
                assert isinstance(found, list) and all(isinstance(s["metric"], dict) for s in found)
        code, err = run_cli(["explain", "r", "--prometheus", server.url, "--prometheus-timeout", "5",
                             "--since", "1000000000", "--until", "1000003600"])
        assert code in (0, 1) and err.count("\n") <= 1, err
        assert err == "" or err.startswith("dualtrack explain: error: "), err
