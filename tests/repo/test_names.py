"""Every training_* and nvml_* name written outside its declaration is declared, with the labels it is used with.

The declarations: the hook's series (trainer_hook.contract: SERIES, and the gauges of the logged keys
with a documented meaning), the exporter's (exporter.metrics: its MetricSpec table) and the recording
rules in rules/ (a recorded name's labels are those its expression yields, plus the rule's own). The
labels Prometheus adds to every scraped series (job, instance, and each target_label/targetLabel of
prometheus.yml and the Kubernetes monitors) are allowed on every declared series.

Read: rules/ (rules/dcgm too), the dashboard generator and the dashboards, every module under dualtrack/,
docs/*.md, README.md and the Kubernetes manifests. Every name must be declared (a name ending in `_`
is a prefix: some declared name must start with it; a counter's or histogram's family name may be
written, but no PromQL selects it); a selector `name{label=...}` must use the labels of `name`'s
declaration (so must the docs' `name{label,...}`). The PromQL of the rules, the dashboards' queries
and the docs' ```promql blocks is parsed: its `by`/`without`, `on`/`ignoring`,
`group_left`/`group_right` and label_replace/label_join/label_values labels must be on the series
they act on, and a panel's legend may only name labels its query's series carry.
"""
from __future__ import annotations

import io
import json
import re
import tokenize
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.support.declarations import PREFIXES, exporter_series, hook_families, hook_series
from tests.support.paths import REPO as ROOT

#: Labels Prometheus itself gives every scraped series (the target's), before any relabeling.
SCRAPE_LABELS = frozenset({"job", "instance"})


# ---------------------------------------------------------------------- the declarations
def target_labels() -> frozenset[str]:
    """job and instance, and every label the scrape configs' relabelings set (prometheus.yml, Kubernetes)."""
    labels = set(SCRAPE_LABELS)
    for path in (ROOT / "prometheus.yml", *sorted((ROOT / "deploy" / "kubernetes").rglob("*.yaml"))):
        labels.update(re.findall(r"\btarget_?[lL]abel:\s*[\"']?(\w+)", path.read_text()))
    return frozenset(labels)


@dataclass(frozen=True)
class Rule:
    """A recording rule: its expression and the labels it sets."""

    expr: str
    labels: frozenset[str]


def rule_files() -> list[Path]:
    """Every rule file: rules/*.yml and rules/dcgm/*.yml."""
    return sorted((ROOT / "rules").rglob("*.yml"))


@cache
def recording_rules() -> dict[str, tuple[Rule, ...]]:
    """Every name the rules in rules/ record -> the rules that record it."""
    rules: dict[str, list[Rule]] = {}
    for path in rule_files():
        for record, expr, _, extra in _rule_nodes(path.read_text()):
            if record is not None:
                rules.setdefault(record, []).append(Rule(expr, frozenset(extra)))
    return {name: tuple(found) for name, found in rules.items()}


def _rule_nodes(text: str) -> Iterator[tuple[str | None, str, int, tuple[str, ...]]]:
    """(record or None for an alert, expr, the expr's first line, the rule's label names) of a rule file."""
    for node in (found for document in yaml.compose_all(text) for found in _mappings(document)):
        fields = {key.value: value for key, value in node.value}
        expr = fields.get("expr")
        if not isinstance(expr, yaml.ScalarNode) or not ({"record", "alert"} & set(fields)):
            continue
        record = fields["record"].value if "record" in fields else None
        labels = fields.get("labels")
        names = tuple(key.value for key, _ in labels.value) if isinstance(labels, yaml.MappingNode) else ()
        yield record, expr.value, expr.start_mark.line + (2 if expr.style in ("|", ">") else 1), names


def _mappings(node: yaml.Node | None) -> Iterator[yaml.MappingNode]:
    if isinstance(node, yaml.MappingNode):
        yield node
        for _, value in node.value:
            yield from _mappings(value)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            yield from _mappings(item)


class Declarations:
    """Each declared name's labels: the hook's and exporter's with the scrape labels, the recorded ones inferred."""

    def __init__(self) -> None:
        scraped = target_labels()
        series: dict[str, frozenset[str] | None] = {**hook_series(), **exporter_series()}
        self.series = {name: None if labels is None else labels | scraped for name, labels in series.items()}
        self.families = hook_families()
        self.rules = recording_rules()
        self._recorded: dict[str, frozenset[str] | None] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.series or name in self.rules

    def labels(self, name: str) -> frozenset[str] | None:
        """The labels series `name` carries; None where not known (not ours, or an expression too dynamic)."""
        if name in self.series:
            return self.series[name]
        if name not in self.rules:
            return None
        if name not in self._recorded:
            self._recorded[name] = None  # a rule that reads itself (never valid) ends here
            found: set[str] = set()
            for rule in self.rules[name]:
                value = PromQL(rule.expr, self.labels).parse()
                if value.labels is None:
                    return None
                found |= value.labels | rule.labels
            self._recorded[name] = frozenset(found)
        return self._recorded[name]


# ---------------------------------------------------------------------- PromQL labels
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                          "bottomk", "topk", "quantile", "limitk", "limit_ratio"})
#: Aggregations that keep the series they select (and their labels).
SELECTING = frozenset({"bottomk", "topk", "limitk", "limit_ratio"})
PRECEDENCE = {"or": 1, "and": 2, "unless": 2, "==": 3, "!=": 3, ">=": 3, "<=": 3, ">": 3, "<": 3,
              "+": 4, "-": 4, "*": 5, "/": 5, "%": 5, "atan2": 5, "^": 6}
SCALAR_FUNCTIONS = frozenset({"time", "pi", "scalar", "start", "end"})
_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
   |(?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
   |(?P<range>\[[^\]]*\])
   |(?P<number>0x[0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?(?:(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)?
      |\$\{\w+\}|\$\w+|\b(?:[Ii]nf|NaN)\b)
   |(?P<name>[A-Za-z_:][\w:]*)
   |(?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){},@])
""", re.VERBOSE)


class PromQLError(ValueError):
    """An expression this reader does not understand."""


@dataclass(frozen=True)
class Value:
    """What an expression yields: its labels (None: not known) and whether it is a scalar."""

    labels: frozenset[str] | None
    scalar: bool = False

    def __or__(self, other: Value) -> Value:
        return Value(None if self.labels is None or other.labels is None else self.labels | other.labels)


SCALAR = Value(frozenset(), scalar=True)


@dataclass(frozen=True)
class Token:
    kind: str
    text: str
    at: int


class PromQL:
    """Reads one PromQL expression for the labels each part yields, noting each label used where it is not."""

    def __init__(self, text: str, labels_of: Callable[[str], frozenset[str] | None]) -> None:
        self.text = text
        self.labels_of = labels_of
        self.tokens = [Token(m.lastgroup or "", m.group(), m.start()) for m in _TOKEN.finditer(text)
                       if m.lastgroup != "space"]
        if sum(len(m.group()) for m in _TOKEN.finditer(text)) != len(text):
            raise PromQLError(f"unexpected character in {text!r}")
        self.tokens.append(Token("end", "", len(text)))
        self.index = 0
        self.problems: list[tuple[int, str]] = []  # (offset in text, what is wrong)
        self.selectors: list[tuple[int, str]] = []  # (offset in text, series name)

    def parse(self) -> Value:
        value = self._expr(0)
        if self._peek().kind != "end":
            raise PromQLError(f"unexpected {self._peek().text!r} at {self._peek().at} in {self.text!r}")
        return value

    # tokens
    def _peek(self) -> Token:
        return self.tokens[self.index]

    def _next(self) -> Token:
        token = self.tokens[self.index]
        if token.kind == "end":
            raise PromQLError(f"unexpected end of {self.text!r}")
        self.index += 1
        return token

    def _accept(self, *texts: str) -> Token | None:
        return self._next() if self._peek().text in texts and self._peek().kind in ("name", "op") else None

    def _expect(self, text: str) -> Token:
        token = self._next()
        if token.text != text:
            raise PromQLError(f"expected {text!r} at {token.at}, not {token.text!r}, in {self.text!r}")
        return token

    def _label_list(self) -> tuple[Token, ...]:
        self._expect("(")
        labels = []
        while not self._accept(")"):
            labels.append(self._next())
            self._accept(",")
        return tuple(labels)

    # the labels used
    def _need(self, labels: Iterable[Token], value: Value, how: str) -> None:
        for label in labels:
            name = label.text.strip("\"'`")
            if value.labels is not None and not value.scalar and name and name not in value.labels:
                have = ", ".join(sorted(value.labels)) or "none"
                self.problems.append((label.at,
                                      f"{how} label {name!r}: not on the series it acts on (they have {have})"))

    # grammar
    def _expr(self, lowest: int) -> Value:
        left = self._unary()
        while (self._peek().kind in ("name", "op") and self._peek().text in PRECEDENCE
               and PRECEDENCE[self._peek().text] >= lowest):
            op = self._next().text
            self._accept("bool")
            matching = self._accept("on", "ignoring")
            keys = self._label_list() if matching else ()
            group = self._accept("group_left", "group_right")
            extra = self._label_list() if group and self._peek().text == "(" else ()
            right = self._expr(PRECEDENCE[op] + (op != "^"))
            left = self._binary(op, left, right, matching.text if matching else "", keys,
                                group.text if group else "", extra)
        return left

    def _binary(self, op: str, left: Value, right: Value, matching: str, keys: tuple[Token, ...],
                group: str, extra: tuple[Token, ...]) -> Value:
        if left.scalar or right.scalar:
            return right if left.scalar else left
        if matching == "on":
            self._need(keys, left, "on (...)")
            self._need(keys, right, "on (...)")
        elif matching == "ignoring":
            self._need(keys, left | right, "ignoring (...)")
        names = frozenset(key.text for key in keys)
        if op in ("and", "unless"):
            return left
        if op == "or":
            return left | right
        if group:
            one, many = (right, left) if group == "group_left" else (left, right)
            self._need(extra, one, f"{group} (...)")
            return many | Value(frozenset(token.text for token in extra))
        if matching == "on":
            return Value(names)
        return left if left.labels is None or matching != "ignoring" else Value(left.labels - names)

    def _unary(self) -> Value:
        if self._accept("-", "+"):
            return self._unary()
        return self._postfix(self._primary())

    def _postfix(self, value: Value) -> Value:
        while True:
            if self._peek().kind == "range":
                self._next()
            elif self._accept("offset"):
                self._accept("-")
                self._next()
            elif self._accept("@"):
                if self._next().text in ("start", "end"):
                    self._label_list()
            else:
                return value

    def _primary(self) -> Value:
        token = self._next()
        if token.text == "(" and token.kind == "op":
            value = self._expr(0)
            self._expect(")")
            return value
        if token.kind in ("string", "number"):
            return SCALAR
        if token.text == "{":
            self._matchers("")
            return Value(None)
        if token.kind != "name":
            raise PromQLError(f"unexpected {token.text!r} at {token.at} in {self.text!r}")
        if token.text in AGGREGATIONS:
            return self._aggregation(token.text)
        if self._peek().text == "(":
            return self._call(token.text)
        labels = self.labels_of(token.text)
        self.selectors.append((token.at, token.text))
        if self._peek().text == "{":
            self._next()
            self._matchers(token.text)
        return Value(labels)

    def _matchers(self, name: str) -> None:
        """Reads a selector's matchers, noting each label that series `name` (if ours) lacks."""
        labels = self.labels_of(name) if ours(name) else None
        while (token := self._next()).text != "}":
            if (token.kind == "name" and self._peek().text in ("=", "!=", "=~", "!~") and labels is not None
                    and token.text not in labels | {"__name__"}):
                self.problems.append((token.at, missing_label(name, token.text, labels)))

    def _arguments(self) -> list[tuple[Token, Value]]:
        self._expect("(")
        arguments = []
        while not self._accept(")"):
            arguments.append((self._peek(), self._expr(0)))
            self._accept(",")
        return arguments

    def _aggregation(self, name: str) -> Value:
        grouping = self._accept("by", "without")
        keys = self._label_list() if grouping else ()
        arguments = self._arguments()
        if not grouping and (grouping := self._accept("by", "without")):
            keys = self._label_list()
        value = arguments[-1][1]
        self._need(keys, value, f"{grouping.text} (...)" if grouping else "")
        names = frozenset(key.text for key in keys)
        if name in SELECTING:
            return value
        if name == "count_values":
            names |= {arguments[0][0].text.strip("\"'`")}
        if grouping and grouping.text == "without":
            return Value(None if value.labels is None else value.labels - names)
        return Value(names)

    def _call(self, name: str) -> Value:
        if name == "label_values":  # Grafana's variable query: label_values([selector,] label)
            self._expect("(")
            value = self._expr(0)
            if self._accept(","):
                self._need([label for label in [self._next()] if label.kind == "name"], value, "label_values")
            self._expect(")")
            return Value(None)
        arguments = self._arguments()
        if name in SCALAR_FUNCTIONS:
            return SCALAR
        if name in ("absent", "absent_over_time"):
            return Value(None)
        vectors = [value for _, value in arguments if not value.scalar]
        value = vectors[0] if vectors else Value(frozenset())
        if name in ("label_replace", "label_join"):
            sources = [token for token, _ in arguments[3:]]  # label_replace's 4th argument, label_join's rest
            self._need(sources[:1] if name == "label_replace" else sources, value, name)
            target = arguments[1][0].text.strip("\"'`")
            return value | Value(frozenset({target}))
        if name in ("sort_by_label", "sort_by_label_desc"):
            self._need([token for token, _ in arguments[1:]], value, name)
        if name == "histogram_quantile" and value.labels is not None:
            self._need([Token("string", "le", arguments[1][0].at)], value, name)
            return Value(value.labels - {"le"})
        return value


# ---------------------------------------------------------------------- what is read
def sources() -> list[Path]:
    """Every file whose training_*/nvml_* names are checked."""
    kubernetes = (ROOT / "deploy" / "kubernetes").rglob("*.yaml")
    return [*rule_files(), ROOT / "dashboards" / "generate.py", *sorted((ROOT / "dashboards").glob("*.json")),
            *sorted((ROOT / "dualtrack").rglob("*.py")), *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md",
            *sorted(kubernetes)]


def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of what is read in `path`: a module's strings and comments, any other file whole."""
    text = path.read_text()
    if path.suffix != ".py":
        yield from enumerate(text.splitlines(), 1)
        return
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.STRING, tokenize.COMMENT):
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line


def promql_texts(path: Path) -> Iterator[tuple[int, str, str]]:
    """(first line, expression, its legend) of the PromQL in `path`: rules' exprs, dashboards' queries (each
    with the legendFormat of its target), ```promql blocks."""
    text = path.read_text()
    if path.suffix == ".yml" or path.name.startswith("prometheusrule"):
        for _, expr, line, _ in _rule_nodes(text):
            yield line, expr, ""
    elif path.suffix == ".json":
        queries: list[tuple[int, str, str]] = []
        for number, row in enumerate(text.splitlines(), 1):
            if match := re.fullmatch(r'\s*"(expr|query|legendFormat)": (".*"),?', row):
                if match.group(1) == "legendFormat":  # a target's keys: expr first
                    queries[-1] = (*queries[-1][:2], json.loads(match.group(2)))
                else:
                    queries.append((number, json.loads(match.group(2)), ""))
        yield from queries
    elif path.suffix == ".md":
        for block in re.finditer(r"^ *```promql\n(.*?)^ *```", text, re.MULTILINE | re.DOTALL):
            for part in re.finditer(r"(?:.+\n)+", block.group(1)):  # expressions apart, blank lines between
                # `<what it is>` stands for an expression the text describes: a series of unknown labels
                yield text.count("\n", 0, block.start(1) + part.start()) + 1, PLACEHOLDER.sub("_", part.group()), ""


PLACEHOLDER = re.compile(r"<[A-Za-z][^<>\n]*>")
NAME = re.compile(r"(?<![\w/.:-])[A-Za-z_]\w*(?::\w+)*(?![\w:]|\.[a-z])")
SELECTOR = re.compile(r"(?<![\w:])([A-Za-z_]\w*(?::\w+)*)\{([^{}]*)\}")
BARE_LABELS = re.compile(r"\s*\w+(?:\s*,\s*\w+)*\s*")
MATCHER = re.compile(r"""(?:^|,)\s*([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*(?:"|'|`|%q|\$)""")


def selector_labels(braces: str, python: bool) -> set[str]:
    """The labels named in a selector's braces: its matchers' or, outside Python (where `{name}` is an
    f-string's field), a bare list as the docs write one (`nvml_gpu_clock_hertz{gpu,uuid,clock}`)."""
    if not python and BARE_LABELS.fullmatch(braces):
        return {label.strip() for label in braces.split(",")}
    return set(MATCHER.findall(braces))


def missing_label(name: str, label: str, labels: frozenset[str]) -> str:
    """What is wrong with a selector of series `name`, whose labels are `labels`, matching on `label`."""
    return f"{name} has no label {label!r} (it has {', '.join(sorted(labels))})"


def ours(name: str) -> bool:
    """A hook, exporter or recorded name of ours: training_*, nvml_*, or level:training_…:operations."""
    return any(part.startswith(PREFIXES) for part in name.split(":"))


def undeclared_names(declared: Declarations, examples: frozenset[str]) -> Iterator[str]:
    """file:line and name of each training_*/nvml_* name no declaration (or rule example) has."""
    every = (*declared.series, *declared.rules, *examples)
    for path in sources():
        for number, line in text_lines(path):
            for name in {m.group() for m in NAME.finditer(line) if ours(m.group())}:
                known = (name in declared or name in declared.families or name in examples
                         or name.endswith("_") and any(other.startswith(name) for other in every))
                if not known:
                    yield f"{path.relative_to(ROOT)}:{number}: {name} is not declared"


def misused_labels(declared: Declarations) -> Iterator[str]:
    """file:line of each selector of ours, and each PromQL grouping or join, using a label its series lack."""
    for path in sources():
        where = path.relative_to(ROOT)
        for number, line in text_lines(path):
            for selector in SELECTOR.finditer(line):
                labels = declared.labels(selector.group(1)) if ours(selector.group(1)) else None
                for label in sorted(selector_labels(selector.group(2), path.suffix == ".py") - {"__name__"}):
                    if labels is not None and label not in labels:
                        yield f"{where}:{number}: {missing_label(selector.group(1), label, labels)}"
        for first, expr, legend in promql_texts(path):
            try:
                reader = PromQL(expr, declared.labels)
                value = reader.parse()
            except PromQLError as error:
                yield f"{where}:{first}: cannot read {error}"
                continue
            for label in sorted(set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend)) - {"__name__"}):
                if value.labels is not None and label not in value.labels:
                    yield f"{where}:{first}: legend {{{{{label}}}}}: not a label of the query's series"
            for at, name in reader.selectors:
                if name in declared.families:
                    yield f"{where}:{first + expr.count(chr(10), 0, at)}: {name} is a family name, no series has it"
            for at, problem in reader.problems:
                yield f"{where}:{first + expr.count(chr(10), 0, at)}: {problem}"


def example_records() -> frozenset[str]:
    """Names the docs' example rules record (`- record: name` in a ```yaml block)."""
    return frozenset(name for path in sources() if path.suffix == ".md"
                     for name in re.findall(r"^\s*- record: (\S+)", path.read_text(), re.MULTILINE))


# ---------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def declared() -> Declarations:
    return Declarations()


def test_every_name_is_declared(declared: Declarations) -> None:
    problems = sorted(set(undeclared_names(declared, example_records())))
    assert not problems, "\n".join(problems)


def test_every_label_is_one_its_series_has(declared: Declarations) -> None:
    problems = sorted(set(misused_labels(declared)))
    assert not problems, "\n".join(problems)


def test_every_recorded_series_has_known_labels(declared: Declarations) -> None:
    """Every recording rule's labels follow from its expression (the label checks above rely on them)."""
    unknown = sorted(name for name in declared.rules if ours(name) and declared.labels(name) is None)
    assert not unknown, unknown


@pytest.mark.parametrize(("expr", "problem"), [
    ("sum by (gpu) (training_steps_total)", "by (...) label 'gpu'"),
    ("nvml_gpu_info * on (uuid) group_left (pod) nvml_gpu_lost", "group_left (...) label 'pod'"),
    ("training_gpu_info and on (job, uuid) nvml_up", "on (...) label 'uuid'"),
    ('label_replace(nvml_up, "a", "$1", "uuid", "(.*)")', "label_replace label 'uuid'"),
    ('rate(training_steps_total{\n  job="a",\n  uuid="x"}[5m])', "training_steps_total has no label 'uuid'"),
    ("sum(nvml_gpu_info) by (name) / on (gpu) sum by (gpu) (nvml_gpu_lost)", "on (...) label 'gpu'"),
])
def test_the_reader_finds_a_misused_label(declared: Declarations, expr: str, problem: str) -> None:
    reader = PromQL(expr, declared.labels)
    reader.parse()
    assert [text for _, text in reader.problems if text.startswith(problem)], reader.problems


def test_the_reader_follows_recorded_labels(declared: Declarations) -> None:
    assert declared.labels("job_run:training_eta_seconds:rate5m") == {"job", "run"}
    reader = PromQL("max by (uuid) (job_run:training_eta_seconds:rate5m) + on (uuid) nvml_gpu_info "
                    '> bool 0 or histogram_quantile(0.9, rate(training_step_duration_seconds_bucket[5m] offset 1h))',
                    declared.labels)
    reader.parse()
    assert [text for _, text in reader.problems] == [
        "by (...) label 'uuid': not on the series it acts on (they have job, run)"]
