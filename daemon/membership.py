"""This node's own membership: joining a cluster, rejoining it, and leaving it.

:class:`Membership` holds the join and leave requests that this daemon has in flight, resends a
join until it is answered, and times both out. The daemon's event loop owns it, as it owns
:class:`~chaos.daemon.relay.TrainerRelay`, and calls it from its handlers and its housekeeping
timer. Everything here runs on the loop's thread.

A join is not stuck with one contact: it holds a list of contacts (``--join`` may name several,
a rejoin adds every member of the last view), sends to one at a time, and moves on to the next
when the current one refuses for want of a scheduler (``not_scheduler``, ``paused``) or stays
silent for :data:`SILENT_SENDS` sends. A contact that refuses may list other members' addresses
(``Refusal.members``), which join the list. All of it within the one ``join_timeout_s``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

import msgspec
from chaos.daemon.dispatch import Handler, scheduler_side
from chaos.daemon.scheduler.role import DaemonContext
from chaos.daemon.scheduler.scale_out import NAT_HELP
from chaos.daemon.states import DaemonState
from chaos.daemon.transport import ReplyPath, Transport

from chaos.protocol import (
    ClusterUpdate,
    ClusterView,
    JoinRequest,
    LeaveCommand,
    LeaveRequest,
    NodeState,
    OpResult,
    PolicyAck,
    Reason,
    Refusal,
    encode,
)
from chaos.protocol.messages import MAX_JOIN_CONTACTS

log = logging.getLogger("chaos.daemon")

SILENT_SENDS = 2
"""Join requests a contact may leave unanswered before the joiner tries the next contact (a
contact that forwards to a working scheduler gets the join admitted well within them)."""
MAX_CONTACTS = 64
"""Most contacts a join holds (configured, then learned from refusals)."""
_RETRY_REASONS = ("not_scheduler", "paused", "overloaded", "id_in_use", "joiner_unreachable")
_WRONG_CONTACT = ("not_scheduler", "paused")
_NEIGHBOR_GONE = ("unknown_peer", "unreachable")
FORWARD_MEMORY_S = 120.0
"""How long a member remembers the way back to a joiner whose join it forwarded (to hand the
scheduler's refusal on)."""
MAX_FORWARDED = 256
"""Most joiners a member remembers the way back to."""


class Membership:
    """This node's join and leave requests.

    Args:
        ctx: The daemon's context.
        transport: The contacts a join goes through.
    """

    def __init__(self, ctx: DaemonContext, transport: Transport) -> None:
        self.ctx = ctx
        self.transport = transport
        self._contacts: list[str] = []
        self._contact_i = 0
        self._sent_to_contact = 0
        self._join_neighbors: list[str] = []
        self._rejoining = False
        self._join_deadline = float("inf")
        self._unknown_neighbors: str | None = None
        """The last refusal of a first join's wanted neighbours (the error if it times out)."""
        self._unreachable: str | None = None
        """The last ``joiner_unreachable`` refusal's words (the error if the join times out)."""
        self._heard = False
        """Whether any contact answered this join (else its timeout says none could be
        reached)."""
        self._forwarded: dict[str, tuple[ReplyPath, float]] = {}
        """Joiners whose joins this member forwarded: the way back to each, and when."""
        self._next_join = float("inf")
        self._leave_op = ""
        self._leave_reply: ReplyPath | None = None
        self._leave_deadline = float("inf")
        self._leave_started = 0.0

    # -- joining ---------------------------------------------------------------------------

    def begin_join(self, now: float, contacts: Sequence[str], neighbors: list[str]) -> None:
        """Becomes ``joining`` and sends a join request to the first of ``contacts``, resent
        until answered (moving on to the next contact when one cannot help) and given up after
        ``join_timeout_s``."""
        h = self.ctx
        h.facts.set_state(DaemonState.JOINING)
        h.facts.election.disarm()
        h.facts.drop_role()
        self._contacts = []
        self._contact_i = 0
        self._sent_to_contact = 0
        self._learn(contacts)
        self._join_neighbors = neighbors
        self._rejoining = False
        self._unreachable = None
        self._heard = False
        self._join_deadline = now + h.cfg.join_timeout_s
        self._send_join(now)

    def _learn(self, addresses: Sequence[str]) -> list[str]:
        """Appends the new ones of ``addresses`` (not this node's own) to the contacts."""
        new = []
        for a in addresses:
            if len(self._contacts) >= MAX_CONTACTS:
                break
            if a != self.ctx.facts.address and a not in self._contacts:
                self._contacts.append(a)
                new.append(a)
        return new

    def _next_contact(self, why: str) -> None:
        """Moves on to the next contact (a no-op with one contact)."""
        if len(self._contacts) < 2:
            return
        self._contact_i = (self._contact_i + 1) % len(self._contacts)
        self._sent_to_contact = 0
        contact = self._contacts[self._contact_i]
        log.info("join: trying contact %s (%s)", contact, why)
        self.ctx.event("join_contact", contact=contact, why=why)

    def _send_join(self, now: float) -> None:
        h = self.ctx
        self._next_join = now + max(0.5, 2 * h.cfg.heartbeat_interval_s)
        if not self._contacts:
            return
        if self._sent_to_contact >= SILENT_SENDS:
            self._next_contact("silent")
        req = JoinRequest(
            sender=h.node_id,
            epoch=h.facts.epoch,
            node_id=h.node_id,
            address=h.facts.address,
            neighbors=self._join_neighbors,
            op_id=uuid.uuid4().hex[:12],
            public_key=h.facts.public_key,
            sign_key=h.facts.sign_key,
            incarnation=h.facts.incarnation,
        )
        self._sent_to_contact += 1
        self.transport.send_contact(self._contacts[self._contact_i], encode(req))

    def on_admitted(self, msg: ClusterUpdate, now: float) -> None:
        """The first update that lists this joining node: it is a member."""
        h = self.ctx
        h.facts.set_state(DaemonState.ACTIVE)
        h.facts.election.adopt(msg.term, msg.sender, now)
        self.transport.close_contacts()
        h.event("joined", epoch=msg.epoch, term=msg.term, scheduler=msg.sender)

    def handlers(self) -> dict[type, Handler]:
        """The join and leave flow: a join request (taken by the scheduler, forwarded to it by
        a member), a member's leave request (the scheduler's side) and the operator's leave."""
        return {
            JoinRequest: self.on_join_request,
            LeaveRequest: scheduler_side(
                self.ctx.facts, lambda role, m, r, t: role.on_leave(m, r, t)
            ),
            LeaveCommand: lambda m, r, t: self.start_leave(r, t),
        }

    def on_join_request(self, msg: JoinRequest, reply: ReplyPath | None, now: float) -> None:
        """A join request: the scheduler starts a scale-out; a member forwards it to the
        scheduler it follows, or, with none, refuses it with the members it knows (the
        joiner's next contacts)."""
        f = self.ctx.facts
        if f.role is not None and f.is_scheduler:
            f.role.on_join(msg, reply, now)
            return
        scheduler = f.election.scheduler
        if scheduler is not None and scheduler != f.node_id and msg.forwarded_by is None:
            fwd = msgspec.structs.replace(msg, forwarded_by=f.node_id, sender=f.node_id)
            if reply is not None:  # the way back, for the scheduler's refusal
                self._remember_forwarded(msg.node_id, reply, now)
            self.ctx.out.send(scheduler, fwd)
            return
        if msg.forwarded_by is None:
            reason = Reason.PAUSED if f.paused else Reason.NOT_SCHEDULER
            no = Refusal(sender=f.node_id, epoch=f.epoch, reason=reason, detail="no scheduler",
                         ref_type="join_request", term=f.term,
                         members=self.contacts_for(msg.address))  # fmt: skip
            self.ctx.out.respond(reply, no)

    def on_refusal(self, msg: Refusal) -> bool:
        """Takes the refusal of this node's join; ``False`` when it refuses something else.

        A join refused for want of a scheduler (``not_scheduler``, ``paused``) or because the
        scheduler's join budget is spent for now (``overloaded``) is resent at the next join
        interval, until ``join_timeout_s``; any other reason ends the daemon (exit code 3). The
        members a refusal lists join the contacts, and a refusal for want of a scheduler moves
        the join on to the next contact (unless nothing was sent to the current one yet: the
        refusal answered an earlier contact). A rejoin whose neighbours are refused
        (``unknown_peer``, ``unreachable``: one left or failed meanwhile) asks again without
        them, once. A first join whose wanted neighbours are so refused waits for them (they
        may be cut off, or failed and joining again) and asks again at each join interval,
        until ``join_timeout_s``, whose error then names them (a campaign joiner exited at once
        when the harness's chosen neighbours were cut off a moment after it chose them).
        """
        h = self.ctx
        if msg.joiner is not None and msg.ref_type == "join_request":
            return self._hand_on(msg)
        if h.facts.state != DaemonState.JOINING or msg.ref_type != "join_request":
            return False
        self._heard = True
        if self._rejoining and self._join_neighbors and msg.reason in _NEIGHBOR_GONE:
            # a rejoin's neighbours are this node's wish, not the user's: one may have gone
            h.event("rejoin_neighbors_dropped", reason=msg.reason, neighbors=self._join_neighbors)
            self._join_neighbors = []
            return True
        if self._join_neighbors and msg.reason in _NEIGHBOR_GONE:
            detail = f"{msg.reason} {msg.detail}"
            if detail != self._unknown_neighbors:
                log.warning("join refused by %s: %s; waiting for them until the join timeout",
                            msg.sender or "?", detail)  # fmt: skip
                h.event("join_neighbors_unknown", reason=msg.reason, detail=msg.detail)
            self._unknown_neighbors = detail
            return True
        if msg.reason == Reason.JOINER_UNREACHABLE:
            if msg.detail != self._unreachable:
                log.warning("join refused by %s: %s; asking again until the join timeout",
                            msg.sender or "?", msg.detail)  # fmt: skip
                h.event("join_unreachable", peer=msg.sender, detail=msg.detail)
            self._unreachable = msg.detail
            return True
        if msg.reason not in _RETRY_REASONS:
            log.error("join refused by %s: %s %s", msg.sender or "?", msg.reason, msg.detail)
            h.event("join_failed", reason=msg.reason, detail=msg.detail)
            h.facts.finish(3)
            return True
        learned = self._learn(msg.members)
        if learned:
            h.event("join_contacts_learned", peer=msg.sender, contacts=learned)
        if msg.reason in _WRONG_CONTACT and self._sent_to_contact > 0:
            self._next_contact(f"{msg.reason} from {msg.sender or '?'}")
        return True

    def _remember_forwarded(self, joiner: str, reply: ReplyPath, now: float) -> None:
        """Keeps the way back to a joiner whose join this member forwards (the newest
        :data:`MAX_FORWARDED`, for :data:`FORWARD_MEMORY_S`)."""
        self._forwarded.pop(joiner, None)
        self._forwarded[joiner] = (reply, now)
        while len(self._forwarded) > MAX_FORWARDED:
            self._forwarded.pop(next(iter(self._forwarded)))

    def _hand_on(self, msg: Refusal) -> bool:
        """Hands the scheduler's refusal of a join this member forwarded on to the joiner,
        over the connection the joiner opened (it may be unreachable at its own address).
        Only the scheduler this member follows may send one; others are dropped."""
        f = self.ctx.facts
        way = self._forwarded.get(msg.joiner or "")
        if way is None or msg.sender != f.election.scheduler:
            return True
        self.ctx.event("join_refusal_handed_on", peer=msg.joiner, reason=msg.reason)
        self.ctx.out.respond(way[0], msgspec.structs.replace(msg, joiner=None))
        return True

    def contacts_for(self, joiner_address: str) -> list[str]:
        """Other members' addresses this node can suggest to a joiner it cannot admit: every
        member of its view but itself and the joiner, active ones first (at most
        :data:`~chaos.protocol.messages.MAX_JOIN_CONTACTS`)."""
        f = self.ctx.facts
        if f.view is None:
            return []
        nodes = [n for n in f.view.nodes
                 if n.id != f.node_id and n.address not in (f.address, joiner_address)]  # fmt: skip
        nodes.sort(key=lambda n: n.state != NodeState.ACTIVE)
        out: list[str] = []
        for n in nodes:
            if n.address not in out:
                out.append(n.address)
        return out[:MAX_JOIN_CONTACTS]

    def rejoin(self, view: ClusterView | None, via: str, now: float) -> None:
        """Joins again through ``via`` after the cluster committed a view without this node,
        asking for the neighbours it had that are still members; the other members of the
        views it knows are the next contacts."""
        h = self.ctx
        nodes = {n.id: n for n in (view.nodes if view else [])}
        contact = nodes[via].address if via in nodes else None
        if contact is None and h.facts.view is not None:
            contact = next((n.address for n in h.facts.view.nodes if n.id == via), None)
        if contact is None:
            return
        old = {n.id: n for n in h.facts.view.nodes} if h.facts.view else {}
        mine = old[h.node_id].neighbors if h.node_id in old else []
        nbrs = [n for n in mine if n in nodes] if nodes else []
        h.event("rejoining", via=via, neighbors=nbrs)
        others = [n.address for v in (view, h.facts.view) if v is not None for n in v.nodes
                  if n.id not in (via, h.node_id)]  # fmt: skip
        self.begin_join(now, [contact, *others], nbrs)
        self._rejoining = True

    # -- leaving ---------------------------------------------------------------------------

    def start_leave(self, reply: ReplyPath | None, now: float) -> None:
        """Asks the scheduler to take this node out (scale-in); ``reply`` gets the result."""
        h = self.ctx
        if h.facts.state == DaemonState.LEAVING:
            return
        if h.facts.state != DaemonState.ACTIVE:
            h.event("left", ok=True, reason=f"was {h.facts.state.value}")
            h.result(reply, "", detail="was not a member")
            h.facts.finish(0)
            return
        h.facts.set_state(DaemonState.LEAVING)
        self._leave_op = uuid.uuid4().hex[:12]
        self._leave_reply = reply
        self._leave_deadline = now + h.cfg.leave_timeout_s
        self._leave_started = now
        h.event("leave_requested", op_id=self._leave_op)
        if not h.out.to_scheduler(self.leave_request()):
            h.event("left", ok=False, reason="no scheduler")
            self._finish_leave(ok=False, reason=Reason.PAUSED)

    def leave_request(self) -> LeaveRequest:
        """The leave request in flight (sent again to a new scheduler)."""
        h = self.ctx
        return LeaveRequest(
            sender=h.node_id, epoch=h.facts.epoch, node_id=h.node_id, op_id=self._leave_op
        )

    def on_leave_result(self, msg: OpResult) -> bool:
        """Finishes the leave when ``msg`` answers it; ``False`` when it answers something else."""
        if not msg.op_id or msg.op_id != self._leave_op:
            return False
        self.ctx.event("left", ok=msg.ok, reason=msg.reason, elapsed_s=msg.elapsed_s)
        self._finish_leave(msg.ok, msg.reason, msg.elapsed_s, msg.epoch)
        return True

    def on_dropped_from_view(self, msg: ClusterUpdate, reply: ReplyPath | None, now: float) -> None:
        """Handles a committed view without this node: the leave is done, or this member was
        dropped (a missed heartbeat) and joins again."""
        h = self.ctx
        if h.facts.state == DaemonState.LEAVING:
            h.out.respond(reply, PolicyAck(sender=h.node_id, epoch=msg.epoch, term=h.facts.term))
            if msg.sender != h.node_id:
                # the scheduler committed a view without this node: the leave is done, whether
                # or not its answer still comes (a leaving scheduler may exit before sending it)
                elapsed = now - self._leave_started
                h.event("left", ok=True, reason=None, elapsed_s=elapsed, epoch=msg.epoch)
                self._finish_leave(True, None, elapsed, msg.epoch)
        elif h.facts.state == DaemonState.ACTIVE and msg.sender != h.node_id:
            self.rejoin(msg.view, msg.sender, now)

    def _finish_leave(
        self, ok: bool, reason: Reason | None, elapsed_s: float = 0.0, epoch: int | None = None
    ) -> None:
        h = self.ctx
        if self._leave_reply is not None:
            h.out.respond(
                self._leave_reply,
                OpResult(
                    sender=h.node_id,
                    epoch=h.facts.epoch if epoch is None else epoch,
                    op_id=self._leave_op,
                    ok=ok,
                    reason=reason,
                    elapsed_s=elapsed_s,
                ),
            )
        h.facts.finish(0)

    # -- timers ----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Resends a pending join, and gives a join or a leave up at its deadline."""
        h = self.ctx
        if h.facts.state == DaemonState.JOINING:
            refused = self.transport.refused_contact()
            if refused is not None:
                why = "the cluster refused our key (another cluster key?)"
                h.event("join_failed", reason=Reason.NOT_AUTHENTICATED, detail=why)
                log.error("join refused by %s: %s: pass the cluster's --cluster-key FILE",
                          refused, why)  # fmt: skip
                h.facts.finish(3)
            elif now > self._join_deadline:
                self._join_timed_out()
            elif now >= self._next_join:
                self._send_join(now)
        stale = [j for j, (_, t) in self._forwarded.items() if now - t > FORWARD_MEMORY_S]
        for j in stale:
            del self._forwarded[j]
        if h.facts.state == DaemonState.LEAVING and now > self._leave_deadline:
            h.event("left", ok=False, reason=Reason.TIMEOUT)
            self._finish_leave(ok=False, reason=Reason.TIMEOUT)

    def _join_timed_out(self) -> None:
        """Gives the join up (exit code 4), naming what stood in its way when a refusal said."""
        h = self.ctx
        detail = self._unreachable or self._unknown_neighbors
        why = (f"no member could reach this device: {self._unreachable}" if self._unreachable
               else f"the neighbours asked for: {self._unknown_neighbors}"
               if self._unknown_neighbors else "")  # fmt: skip
        if not self._heard and not self._rejoining and self._contacts:
            detail = why = (f"no contact ever answered ({', '.join(self._contacts)}): this "
                            "device could not reach any of them (a wrong --join address, or "
                            "a firewall or NAT that blocks its outbound connections); "
                            f"{NAT_HELP}")  # fmt: skip
        h.event("join_failed", reason=Reason.TIMEOUT, **({"detail": detail} if detail else {}))
        log.error("join timed out after %.1f s%s", h.cfg.join_timeout_s,
                  f" ({why})" if why else "")  # fmt: skip
        h.facts.finish(4)
