"""A tree session's trajectory forest (miles' v2 sessions), free of I/O and of locks.

A v2 session is a forest of nodes, one per committed generation. A node holds the whole
root-to-node token state (:class:`webapp.tito.TitoState`: the messages ending with the node's
assistant reply, and the ids) and its record's summary (:class:`webapp.samples.TurnRecord`).
The forest is append-only; ``seq`` (commit order) is the only ordering key, as in miles
(``miles/rollout/session/v2/tree_trajectory.py`` at 31f1ca96).

A request is positioned by its messages: it attaches under the deepest node whose whole path
of messages is a prefix of the request (message equality decided by a matcher,
``webapp.matchers``), ties on depth going to the latest ``seq``; no such node is a new root.
Nothing here decides whether a branch was a retry: that is the samples picker's business.
Serving policy (positioning errors, locks, the journal) lives in the session core.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from webapp.samples import TurnRecord
from webapp.session_errors import TreeFull
from webapp.tito import TitoState

__all__ = ["MAX_NODES", "AttachPoint", "SessionTree", "TreeNode"]

Message = dict[str, Any]
# matcher(stored, request) -> the two messages are the same turn (webapp.matchers.MessageMatcher)
Matcher = Callable[[Message, Message], bool]

MAX_NODES = 1024  # miles' cap: far past it a harness is not replaying history verbatim


@dataclass(eq=False)
class TreeNode:
    """The end of one generation: its record is 1:1 with the node."""

    seq: int
    parent: TreeNode | None
    state: TitoState  # root -> node: messages (ending with this node's reply) and token ids
    turn: TurnRecord  # this node's record (prompt_len, output ids, logprobs, its bytes)
    response_id: str  # the engine reply's id: the join key between an agent's branch and a leaf
    committed_at: float  # wall clock, for display only (never order by it: ``seq`` orders)
    children: list[TreeNode] = field(default_factory=list, repr=False)

    @property
    def delta_start(self) -> int:
        """Index in ``state.messages`` of the first message this node added."""
        return len(self.parent.state.messages) if self.parent is not None else 0

    @property
    def delta(self) -> tuple[Message, ...]:
        """The messages this node added: the request's new ones, then the assistant reply."""
        return self.state.messages[self.delta_start:]

    @property
    def truncated(self) -> bool:
        """Ended at the length cap: the path is closed for good (miles answers 409 to extend it)."""
        return bool(self.turn.finish_reason == "length")

    @property
    def completion_span(self) -> tuple[int, int]:
        """This node's sampled tokens within ``state.token_ids``."""
        return self.turn.prompt_len, self.turn.prompt_len + len(self.turn.output_ids)

    def path(self) -> list[TreeNode]:
        """Root -> this node."""
        nodes: list[TreeNode] = []
        node: TreeNode | None = self
        while node is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes


@dataclass(frozen=True)
class AttachPoint:
    node: TreeNode | None  # None: a new root
    matched: int  # request messages consumed by the node's path
    best_overlap: int  # the deepest overlap seen, partial deltas included (diagnostics)


class SessionTree:
    """The forest plus its append-only commit surface."""

    def __init__(self) -> None:
        self.nodes: list[TreeNode] = []  # seq order
        self.roots: list[TreeNode] = []

    def __len__(self) -> int:
        return len(self.nodes)

    def leaves(self) -> list[TreeNode]:
        return [node for node in self.nodes if not node.children]

    def check_room(self) -> None:
        """Raise :class:`TreeFull` if no node can be added (checked before a generation runs)."""
        if len(self.nodes) >= MAX_NODES:
            raise TreeFull(MAX_NODES)

    def add(self, parent: TreeNode | None, state: TitoState, turn: TurnRecord, *, response_id: str,
            committed_at: float) -> TreeNode:
        self.check_room()
        node = TreeNode(len(self.nodes), parent, state, turn, response_id, committed_at)
        self.nodes.append(node)
        (parent.children if parent is not None else self.roots).append(node)
        return node

    def find_attach_point(self, messages: Sequence[Message], matcher: Matcher = operator.eq) -> AttachPoint:
        """The deepest node whose whole path of messages is a prefix of ``messages``.

        A node is entered only once its parent's delta is wholly matched; twins whose deltas
        both match tie on depth and the latest ``seq`` wins. Never mutates the forest."""
        best: TreeNode | None = None
        best_matched = -1
        best_overlap = 0
        stack: list[tuple[TreeNode, int]] = [(root, 0) for root in reversed(self.roots)]
        while stack:
            node, offset = stack.pop()
            delta = node.delta
            i = 0
            while i < len(delta) and offset + i < len(messages) and matcher(delta[i], messages[offset + i]):
                i += 1
            best_overlap = max(best_overlap, offset + i)
            if i < len(delta):
                continue  # a partial delta: neither this node nor its subtree can be the attach point
            matched = offset + len(delta)
            if matched > best_matched or (matched == best_matched and best is not None and node.seq > best.seq):
                best, best_matched = node, matched
            stack.extend((child, matched) for child in reversed(node.children))
        if best is None:
            return AttachPoint(None, 0, best_overlap)
        return AttachPoint(best, best_matched, best_overlap)

    def metadata(self) -> dict[str, Any]:
        """miles' ``metadata.tree`` block: node and leaf tables in commit order."""
        nodes = [{"id": n.seq, "parent": n.parent.seq if n.parent is not None else None, "seq": n.seq,
                  "truncated": n.truncated, "committed_at": n.committed_at,
                  "completion_span": list(n.completion_span), "num_tokens": len(n.state.token_ids),
                  "response_id": n.response_id} for n in self.nodes]
        leaves = [{"node_id": leaf.seq, "path_node_ids": [n.seq for n in leaf.path()]} for leaf in self.leaves()]
        return {"nodes": nodes, "leaves": leaves}
