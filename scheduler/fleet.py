"""The fleet: which machines exist, how they are grouped, and what each team may use.

A fleet file is the YAML described in docs/traces.md ("Fleet YAML"). It declares machines by shape, not
one by one: a block is ``racks × machines_per_rack`` identical machines, and every machine gets the
topology path ``cluster/block/rN/mM`` from its position. ``parse_fleet`` turns the text into frozen
models; it never opens a file, so the caller decides where the text comes from and what ``source``
name to show in errors.

Errors are the point of this module as much as the happy path: a fleet file is written by hand, so
every mistake is reported as an ``InputError`` with the line, a field path such as
``clusters[0].blocks[1].racks`` and a sentence that says how to fix it. To keep line numbers we
walk the YAML node tree (``yaml.compose``) instead of the plain dicts ``yaml.safe_load`` returns.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from scheduler.errors import InputError
from scheduler.models import INFERENCE_PARTITION, MOST_GPU_MEMORY_GB, QUOTA_LARGEST, Machine, Quota

DEFAULT_QUOTA_KEY = "*"
"""A quotas entry with this name applies to every team without an entry of its own."""

GPU_MEMORY_GB = {"H100": 80.0, "H200": 141.0, "A100": 80.0, "B200": 192.0, "L40S": 48.0, "V100": 32.0}
"""Memory per GPU when a block does not say; the common SKU of each type."""

FALLBACK_GPU_MEMORY_GB = 80.0
DEFAULT_PARTITION = "training"

_TOP_KEYS = ("clusters", "quotas")
_CLUSTER_KEYS = ("name", "blocks")
_BLOCK_REQUIRED = ("name", "racks", "machines_per_rack", "gpus_per_machine", "gpu_type")
_BLOCK_KEYS = _BLOCK_REQUIRED + ("gpu_memory_gb", "partition")
_QUOTA_KEYS = ("guaranteed", "max", "queue_cap")

_HINTS = {
    "clusters": "a list of clusters, each `- name: c1` with `blocks:`",
    "blocks": "a list of blocks, each with name, racks, machines_per_rack, gpus_per_machine, gpu_type",
    "name": "a short name without '/' or spaces, e.g. `name: b0`",
    "racks": "the number of racks in the block, e.g. `racks: 8`",
    "machines_per_rack": "the number of machines in each rack, e.g. `machines_per_rack: 16`",
    "gpus_per_machine": "the number of GPUs in each machine, e.g. `gpus_per_machine: 8`",
    "gpu_type": "the GPU model, e.g. `gpu_type: H100`",
}


class ClusterFleet(BaseModel):
    """One cluster's machines, in file order: block, then rack, then machine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    machines: tuple[Machine, ...]

    @property
    def total_gpus(self) -> int:
        return sum(m.gpus for m in self.machines)


class Fleet(BaseModel):
    """Every cluster and every team's quota.

    ``quotas`` holds the named teams only; the ``"*"`` entry, if any, is ``default_quota``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    clusters: tuple[ClusterFleet, ...]
    quotas: dict[str, Quota] = {}
    default_quota: Quota | None = None

    @property
    def every_quota(self) -> dict[str, Quota]:
        """Each team's quota and, under ``"*"``, the default: as the store and the scheduler keep them."""
        default = {DEFAULT_QUOTA_KEY: self.default_quota} if self.default_quota is not None else {}
        return {**self.quotas, **default}

    def quota_for(self, team: str) -> Quota | None:
        """The team's own quota, else the default; None means the team has no quota at all."""
        return self.quotas.get(team, self.default_quota)

    @property
    def total_gpus(self) -> int:
        return sum(c.total_gpus for c in self.clusters)

    def cluster(self, name: str) -> ClusterFleet:
        for cluster in self.clusters:
            if cluster.name == name:
                return cluster
        known = ", ".join(c.name for c in self.clusters)
        raise KeyError(f"no cluster named {name!r}; the fleet has: {known}")


def guarantees_beyond_capacity(fleet: Fleet) -> list[str]:
    """Warnings, one per cluster too small for the teams' guarantees taken together.

    Each cluster's cycles hold every team to its quota there, so a cluster whose GPUs are fewer
    than the guarantees add up to cannot give every team under its guarantee what it is owed at
    once: a team waiting for its guarantee may find no borrowed GPUs left to reclaim, only GPUs
    other teams hold within theirs. The ``"*"`` default's guarantee counts once: any team
    without its own entry has it. Such a file is taken (an operator may mean it, as a bank may
    lend more than it holds), but said."""
    owed = {team: q.guaranteed for team, q in fleet.quotas.items() if q.guaranteed > 0}
    if fleet.default_quota is not None and fleet.default_quota.guaranteed > 0:
        owed['"*" (each team without its own entry)'] = fleet.default_quota.guaranteed
    total = sum(owed.values())
    largest = sorted(owed.items(), key=lambda item: (-item[1], item[0]))
    shown = ", ".join(f"{team} {n:,}" for team, n in largest[:4]) + (", ..." if len(largest) > 4 else "")
    warnings = []
    for cluster in fleet.clusters:
        gpus = cluster.total_gpus
        if total <= gpus:
            continue
        inference = sum(m.gpus for m in cluster.machines if m.partition == INFERENCE_PARTITION)
        of_them = f" ({inference:,} of them in the inference partition, for inference jobs only)" if inference else ""
        warnings.append(
            f"cluster {cluster.name} has {gpus:,} GPUs{of_them}, but the teams' guarantees add up to {total:,} "
            f"({shown}): not every team can hold its guarantee at once, and one under its guarantee may wait "
            f"for GPUs other teams hold within theirs; lower the guarantees to {gpus:,} in all, or add machines")
    return warnings


# A fleet file declares machines by shape: a thousand blocks and ten thousand teams' quotas fit
# in a megabyte. The YAML reader builds the whole document before a word of it is checked (a
# 5 MB list took 1.6 GB and two minutes to be refused), so a larger file is refused unread.
MOST_FLEET_FILE_CHARS = 1 << 20


def parse_fleet(text: str, source: str) -> Fleet:
    """Read a fleet YAML document; raise ``InputError`` pointing at the first mistake."""
    if len(text) > MOST_FLEET_FILE_CHARS:
        raise InputError(source, None, None, f"is {len(text):,} characters long; a fleet file is at most "
                                             f"{MOST_FLEET_FILE_CHARS:,} (it declares machines by shape: "
                                             "blocks of racks × machines_per_rack)")
    try:
        # The reader checks the characters as the loader is made: a control character fails here.
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise InputError(source, line, None, f"holds the control character U+{exc.character:04X}, which YAML "
                                             "does not allow; remove it (or save the file as UTF-8 text)") from None
    try:
        try:
            root = loader.get_single_node()
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            line = mark.line + 1 if mark is not None else None
            problem = getattr(exc, "problem", None) or str(exc)
            if "another document" in problem:
                message = "holds more than one YAML document; keep one fleet (remove the `---` line)"
            else:
                message = f"is not valid YAML ({problem}); check the indentation and quoting here"
            raise InputError(source, line, None, message) from None
        if root is None:
            raise InputError(
                source, 1, "clusters", "the file is empty; a fleet needs a `clusters:` list"
            )
        return _FleetReader(source, loader).fleet(root)
    except RecursionError:  # PyYAML composes and constructs nested collections recursively
        raise InputError(source, loader.line + 1, None, "nests lists or mappings too deeply to be a fleet; "
                                             "a fleet is clusters, blocks and quotas, a few levels deep") from None
    finally:
        loader.dispose()


# --- Reading the node tree ---------------------------------------------------------------------


_UNREADABLE = object()  # a scalar its tag cannot read (`!!int abc`)
# Numbers as they look: signed, so that `-4` is refused as negative, and `2.5` as not whole.
_DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9]*)(\.[0-9]*)?([eE][-+]?[0-9]+)?|[-+]?\.[0-9]+([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF|nan|NaN|NAN)")
MAX_GPUS_PER_MACHINE = 1024
# A cluster's, block's, rack's or machine's name: a part of machine ids, which agents report and
# Temporal's workflow ids carry ("scheduler-<cluster>": a fleet file's 995-character cluster was
# stored, and every control worker's start failed on it after).
MAX_NAME_CHARS = 64


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a part of a machine id, or None."""
    if not name or "/" in name or not name.isprintable() or any(c.isspace() for c in name):
        return "must be printable characters without '/' or spaces"
    if len(name) > MAX_NAME_CHARS:
        return f"is {len(name)} characters; at most {MAX_NAME_CHARS}"
    return None
# A GPU type as agents report it in every heartbeat, whose model takes no longer one: a fleet
# file's longer type made a stack whose agent was refused at every heartbeat, so no job ran.
MAX_GPU_TYPE_CHARS = 200


def gpu_type_problem(gpu_type: str) -> str | None:
    """Why `gpu_type` cannot be a GPU type, or None."""
    if not gpu_type.strip() or not gpu_type.isprintable():
        return "must be a non-empty string of printable characters"
    if len(gpu_type) > MAX_GPU_TYPE_CHARS:
        return f"is {len(gpu_type)} characters; at most {MAX_GPU_TYPE_CHARS}"
    return None


MAX_MACHINES_PER_BLOCK = 100_000
MAX_MACHINES_PER_FLEET = 100_000  # across its clusters: 800,000 GPUs of 8, past any fleet there is
MAX_GPUS_PER_FLEET = 1_000_000  # and so GPUs too: 100,000 machines of 1,024 would take gigabytes


class _FleetReader:
    """Walks the composed YAML, checking each value where its line number is still known."""

    def __init__(self, source: str, loader: yaml.SafeLoader):
        self.source = source
        self.loader = loader
        self.machines = 0  # read so far, in every cluster
        self.gpus = 0

    def fleet(self, root: yaml.Node) -> Fleet:
        top = self.mapping(root, "", allowed=_TOP_KEYS, required=("clusters",), what="the fleet file")
        cluster_nodes = self.sequence(top["clusters"], "clusters")
        clusters: list[ClusterFleet] = []
        first_seen: dict[str, int] = {}
        for i, node in enumerate(cluster_nodes):
            field = f"clusters[{i}]"
            cluster = self.cluster(node, field)
            self.unique(cluster.name, first_seen, _value_of(node, "name"), f"{field}.name", "cluster")
            clusters.append(cluster)
        quotas, default = self.quotas(top["quotas"]) if "quotas" in top else ({}, None)
        return Fleet(clusters=tuple(clusters), quotas=quotas, default_quota=default)

    def cluster(self, node: yaml.Node, field: str) -> ClusterFleet:
        keys = self.mapping(node, field, allowed=_CLUSTER_KEYS, required=_CLUSTER_KEYS, what="a cluster")
        name = self.name(keys["name"], f"{field}.name")
        machines: list[Machine] = []
        first_seen: dict[str, int] = {}
        for j, block_node in enumerate(self.sequence(keys["blocks"], f"{field}.blocks")):
            block_field = f"{field}.blocks[{j}]"
            block_machines = self.block(block_node, block_field, name)
            name_node = _value_of(block_node, "name")
            self.unique(block_machines[0].block, first_seen, name_node, f"{block_field}.name", "block")
            machines.extend(block_machines)
        return ClusterFleet(name=name, machines=tuple(machines))

    def block(self, node: yaml.Node, field: str, cluster: str) -> list[Machine]:
        keys = self.mapping(node, field, allowed=_BLOCK_KEYS, required=_BLOCK_REQUIRED, what="a block")
        name = self.name(keys["name"], f"{field}.name")
        racks = self.positive_int(keys["racks"], f"{field}.racks")
        per_rack = self.positive_int(keys["machines_per_rack"], f"{field}.machines_per_rack")
        gpus = self.positive_int(keys["gpus_per_machine"], f"{field}.gpus_per_machine")
        if gpus > MAX_GPUS_PER_MACHINE:
            raise self.error(keys["gpus_per_machine"], f"{field}.gpus_per_machine",
                             f"is {gpus}; a machine holds at most {MAX_GPUS_PER_MACHINE} GPUs here")
        if racks * per_rack > MAX_MACHINES_PER_BLOCK:
            raise self.error(keys["racks"], f"{field}.racks",
                             f"{racks} racks of {per_rack} machines is {racks * per_rack} machines; a block "
                             f"holds at most {MAX_MACHINES_PER_BLOCK}: split it into several blocks")
        self.machines += racks * per_rack
        if self.machines > MAX_MACHINES_PER_FLEET:  # checked before the machines are built
            raise self.error(keys["racks"], f"{field}.racks",
                             f"brings the fleet to {self.machines} machines; a fleet file holds at most "
                             f"{MAX_MACHINES_PER_FLEET}: give fewer racks or machines_per_rack")
        self.gpus += racks * per_rack * gpus
        if self.gpus > MAX_GPUS_PER_FLEET:
            raise self.error(keys["gpus_per_machine"], f"{field}.gpus_per_machine",
                             f"brings the fleet to {self.gpus} GPUs; a fleet file holds at most "
                             f"{MAX_GPUS_PER_FLEET}: give fewer machines or GPUs per machine")
        gpu_type = self.text(keys["gpu_type"], f"{field}.gpu_type")
        if (problem := gpu_type_problem(gpu_type)) is not None:
            raise self.error(keys["gpu_type"], f"{field}.gpu_type", problem)
        if "gpu_memory_gb" in keys:
            memory = self.positive_number(keys["gpu_memory_gb"], f"{field}.gpu_memory_gb", MOST_GPU_MEMORY_GB)
        else:
            memory = GPU_MEMORY_GB.get(gpu_type, FALLBACK_GPU_MEMORY_GB)
        partition = (
            self.text(keys["partition"], f"{field}.partition")
            if "partition" in keys
            else DEFAULT_PARTITION
        )
        if partition != INFERENCE_PARTITION and partition.casefold() == INFERENCE_PARTITION:
            # Any other name is a training partition: a capital letter would quietly turn the
            # inference machines into training ones.
            raise self.error(keys["partition"], f"{field}.partition",
                             f"is {partition!r}; the inference partition is spelt {INFERENCE_PARTITION!r}")
        return [
            Machine(
                id=f"{cluster}/{name}/r{r}/m{m}",
                cluster=cluster,
                block=name,
                rack=f"r{r}",
                gpus=gpus,
                gpu_type=gpu_type,
                gpu_memory_gb=memory,
                partition=partition,
            )
            for r in range(racks)
            for m in range(per_rack)
        ]

    def quotas(self, node: yaml.Node) -> tuple[dict[str, Quota], Quota | None]:
        if self.is_null(node):
            return {}, None
        if isinstance(node, yaml.MappingNode):
            for key_node, _ in node.value:
                if (not isinstance(key_node, yaml.ScalarNode) or self.is_null(key_node)
                        or not str(key_node.value).strip() or not str(key_node.value).isprintable()):
                    raise self.error(key_node, "quotas",
                                     f"a team's name must be plain text, got {self.shown(key_node)}")
        entries = self.mapping(node, "quotas", allowed=None, required=(), what="quotas")
        quotas: dict[str, Quota] = {}
        for team, value in entries.items():
            quotas[team] = self.quota(value, f"quotas.{team}")
        default = quotas.pop(DEFAULT_QUOTA_KEY, None)
        return quotas, default

    def quota(self, node: yaml.Node, field: str) -> Quota:
        if not isinstance(node, yaml.MappingNode):
            raise self.error(
                node,
                field,
                f"must be a mapping like {{guaranteed: 64, max: 256, queue_cap: 500}}, got {self.shown(node)}",
            )
        keys = self.mapping(node, field, allowed=_QUOTA_KEYS, required=(), what="a quota")
        guaranteed = (
            self.count(keys["guaranteed"], f"{field}.guaranteed", "GPUs") if "guaranteed" in keys else 0
        )
        maximum = self.optional_count(keys.get("max"), f"{field}.max", "GPUs")
        queue_cap = self.optional_count(keys.get("queue_cap"), f"{field}.queue_cap", "queued jobs")
        if maximum is not None and maximum < guaranteed:
            raise self.error(
                keys["max"],
                f"{field}.max",
                f"is {maximum}, below guaranteed ({guaranteed}); raise max to at least {guaranteed} "
                "or lower guaranteed",
            )
        return Quota(guaranteed=guaranteed, max=maximum, queue_cap=queue_cap)

    # --- Shapes ----------------------------------------------------------------------------------

    def mapping(
        self,
        node: yaml.Node,
        field: str,
        *,
        allowed: tuple[str, ...] | None,
        required: tuple[str, ...],
        what: str,
    ) -> dict[str, yaml.Node]:
        """The mapping's values by key; refuses duplicate, unknown (if ``allowed``) and missing keys."""
        if not isinstance(node, yaml.MappingNode):
            raise self.error(
                node,
                field or None,
                f"{what} must be a mapping of keys to values, got {self.shown(node)}",
            )
        values: dict[str, yaml.Node] = {}
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            path = f"{field}.{key}" if field else key
            if key in values:
                raise self.error(
                    key_node, path, f"appears twice in {what} (first on line {lines[key]}); keep one"
                )
            if allowed is not None and key not in allowed:
                guess = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean '{guess[0]}'?)" if guess else ""
                raise self.error(
                    key_node,
                    path,
                    f"is not a known key of {what}{hint}; allowed keys: {', '.join(allowed)}",
                )
            values[key] = value_node
            lines[key] = _line(key_node)
        for key in required:
            if key not in values:
                path = f"{field}.{key}" if field else key
                hint = _HINTS.get(key, "a value")
                raise self.error(node, path, f"is missing from {what}; add `{key}:` with {hint}")
        return values

    def sequence(self, node: yaml.Node, field: str) -> list[yaml.Node]:
        hint = _HINTS.get(field.rsplit(".", 1)[-1], "a list")
        if not isinstance(node, yaml.SequenceNode):
            raise self.error(node, field, f"must be {hint}, got {self.shown(node)}")
        if not node.value:
            raise self.error(node, field, f"is empty; it must hold at least one entry ({hint})")
        return list(node.value)

    def unique(
        self, name: str, first_seen: dict[str, int], node: yaml.Node, field: str, what: str
    ) -> None:
        if name in first_seen:
            raise self.error(
                node,
                field,
                f"{what} name {name!r} is already used on line {first_seen[name]}; give each {what} its own name",
            )
        first_seen[name] = _line(node)

    # --- Scalars ---------------------------------------------------------------------------------

    def value(self, node: yaml.Node) -> Any:
        """The node's value, or ``_UNREADABLE`` when its tag cannot make one (``!!int abc``)."""
        try:
            return self.loader.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, TypeError, KeyError, AttributeError):
            return _UNREADABLE

    def is_null(self, node: yaml.Node) -> bool:
        return isinstance(node, yaml.ScalarNode) and self.value(node) is None

    def shown(self, node: yaml.Node) -> str:
        """How to quote a bad value back to the user."""
        if isinstance(node, yaml.MappingNode):
            return "a mapping"
        if isinstance(node, yaml.SequenceNode):
            return "a list"
        value = self.value(node)
        if value is _UNREADABLE:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            return f"{tag} {node.value!r}, which is no value of that tag"
        if value is None:
            return "nothing"
        if isinstance(value, str):
            return repr(value)
        return yaml.safe_dump(value, default_flow_style=True).split("\n", 1)[0].strip()

    def plain_number(self, node: yaml.Node, field: str) -> None:
        """Refuse a number YAML reads otherwise than it looks: `010` is 8, `0x10` 16, `1_6` 16
        and `1:00` 60 to YAML 1.1; a count is written in decimal digits, as in a trace."""
        if isinstance(node, yaml.ScalarNode) and node.style is None and not _DECIMAL.fullmatch(node.value):
            value = self.value(node)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                raise self.error(node, field, f"is written {node.value!r}, which YAML reads as {value}; "
                                              "write it in plain decimal digits, without leading zeros")

    def positive_int(self, node: yaml.Node, field: str) -> int:
        self.plain_number(node, field)
        value = self.value(node) if isinstance(node, yaml.ScalarNode) else None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        raise self.error(node, field, f"must be a positive integer, got {self.shown(node)}")

    def count(self, node: yaml.Node, field: str, unit: str) -> int:
        self.plain_number(node, field)
        value = self.value(node) if isinstance(node, yaml.ScalarNode) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > QUOTA_LARGEST:
            raise self.error(node, field, f"must be at most {QUOTA_LARGEST} {unit}, got {self.shown(node)}")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise self.error(
            node, field, f"must be a whole number of {unit}, 0 or more, got {self.shown(node)}"
        )

    def optional_count(self, node: yaml.Node | None, field: str, unit: str) -> int | None:
        if node is None or self.is_null(node):
            return None  # absent or null: no limit
        return self.count(node, field, unit)

    def positive_number(self, node: yaml.Node, field: str, most: float) -> float:
        self.plain_number(node, field)
        value = self.value(node) if isinstance(node, yaml.ScalarNode) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value:
            if value > most:  # before float(): an integer of 400 digits overflowed it (a traceback)
                raise self.error(node, field, f"must be at most {most:,.0f}, got {self.shown(node)}")
            return float(value)
        raise self.error(node, field, f"must be a positive number, got {self.shown(node)}")

    def text(self, node: yaml.Node, field: str) -> str:
        value = self.value(node) if isinstance(node, yaml.ScalarNode) else None
        if isinstance(value, str) and value.strip() and value.strip().isprintable():
            return value.strip()
        raise self.error(node, field, f"must be a non-empty string of printable characters, got {self.shown(node)}")

    def name(self, node: yaml.Node, field: str) -> str:
        """A path segment of machine ids, so it must not contain '/' or whitespace."""
        value = self.value(node) if isinstance(node, yaml.ScalarNode) else None
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            # As written: YAML reads `010` as 8 and `0x1F` as 31, but the ids say what the file says.
            name = value if isinstance(value, str) else str(node.value)
            if name_problem(name) is None:
                return name
        raise self.error(
            node,
            field,
            f"must be a name of up to {MAX_NAME_CHARS} printable characters without '/' or spaces (it becomes part of "
            f"machine ids), got {self.shown(node)}",
        )

    def error(self, node: yaml.Node, field: str | None, message: str) -> InputError:
        return InputError(self.source, _line(node), field, message)


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _value_of(mapping: yaml.MappingNode, key: str) -> yaml.Node:
    """The value node of a key already known to be in the mapping."""
    return next(v for k, v in mapping.value if k.value == key)
