"""Users, organisations and tokens: who a request is, what it may write, and whether it can pay for compute.

``whoami`` is part of the protocol: the client asks it for the default namespace of uploads and of Jobs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from converter.testing.hub.model import User, object_id
from converter.testing.hub.wire import HubError, Request, Response, json_response

if TYPE_CHECKING:
    from converter.testing.hub.server import HubServer


class UsersMixin:
    """The server's accounts and their rules (part of HubServer)."""

    _lock: threading.RLock
    _users: dict[str, User]
    _tokens: dict[str, tuple[str, str]]  # token -> (user, role)
    _org_can_pay: dict[str, bool]

    def add_user(
        self, name: str, token: str, orgs: Iterable[str] = (), *, role: str = "write", can_pay: bool = True
    ) -> None:
        """Register a user (member of ``orgs``) with one token; ``role`` "read" tokens cannot write.

        ``can_pay=False`` makes a free account (no PRO, no credits), which the Jobs API refuses in its own namespace.
        """
        with self._lock:
            self._users[name] = User(name, set(orgs), can_pay)
            self._tokens[token] = (name, role)

    def add_token(self, user: str, token: str, role: str = "read") -> None:
        """Give an existing user another token, e.g. a read-only one to test permission errors."""
        with self._lock:
            if user not in self._users:
                raise KeyError(f"unknown user {user!r}")
            self._tokens[token] = (user, role)

    def set_can_pay(self, namespace: str, can_pay: bool) -> None:
        """Whether a user (PRO) or an organisation (credits) can pay for Jobs; every one can unless told here."""
        with self._lock:
            if namespace in self._users:
                self._users[namespace].can_pay = can_pay
            else:
                self._org_can_pay[namespace] = can_pay

    def can_pay(self, namespace: str) -> bool:
        """Whether Jobs may run under ``namespace`` (a user's PRO, an organisation's credits)."""
        user = self._users.get(namespace)
        return user.can_pay if user is not None else self._org_can_pay.get(namespace, True)

    def redact(self, text: str) -> str:
        """Replace every registered token in ``text``: used before showing client output in assertion messages."""
        for token in self._tokens:
            text = text.replace(token, "<TOKEN>")
        return text

    def _authenticate(self, header: str | None) -> tuple[User | None, str | None]:
        if not header:
            return None, None
        scheme, _, token = header.partition(" ")
        entry = self._tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if entry is None:
            # huggingface_hub special-cases this exact message (not mapped to RepositoryNotFoundError).
            msg = "Invalid credentials in Authorization header"
            raise HubError(401, msg, headers={"X-Error-Message": msg})
        return self._users[entry[0]], entry[1]

    @staticmethod
    def _is_member(user: User | None, namespace: str) -> bool:
        return user is not None and (user.name == namespace or namespace in user.orgs)

    def _can_write(self, user: User | None, role: str | None, namespace: str) -> bool:
        return self._is_member(user, namespace) and role == "write"

    def _check_write(self, req: Request, namespace: str) -> None:
        if req.user is None:
            raise HubError(401, "You must be authenticated to perform this operation")
        if req.role != "write":
            raise HubError(403, "You have read access but not the required permissions for this operation")
        if not self._is_member(req.user, namespace):
            raise HubError(403, f"You don't have the rights to write to the namespace {namespace!r}")


def whoami(hub: HubServer, req: Request) -> Response:
    if req.user is None:
        raise HubError(401, "Invalid username or password.")
    user = req.user
    return json_response(
        {
            "type": "user",
            "id": object_id(user.name),
            "name": user.name,
            "fullname": user.name.title(),
            "email": f"{user.name}@example.com",
            "emailVerified": True,
            "canPay": user.can_pay,
            "isPro": user.can_pay,
            "avatarUrl": f"/avatars/{user.name}.svg",
            "orgs": [{"type": "org", "name": org, "fullname": org, "roleInOrg": "write"} for org in sorted(user.orgs)],
            "auth": {
                "type": "access_token",
                "accessToken": {"displayName": "fake-hub", "role": req.role, "createdAt": "2026-01-01T00:00:00.000Z"},
            },
        }
    )


ROUTES = [(("GET",), r"/api/whoami-v2", whoami)]
