"""The one interface every harness-facing protocol implements, and all the relay may know of one.

A protocol turns a client's request body into the chat-completions request vLLM serves (request
translation) and the engine's output back into its own wire shape, whole or as a stream of
events (emission). What differs between protocols beyond that is declared here as attributes,
so the relay asks, never probes:

- `upstream_path`: the engine endpoint the translated request goes to;
- `normalises_messages`: the translation already ran `normalize_messages` over the chat
  messages (on the new turns only, for a resumed request), so the relay must not again;
- `passes_engine_ids`: the emission passes the engine's prompt id array through to the client
  (or drops it) unread, so the relay hands it over as its JSON text; the others only count
  those ids, and are handed the array the capture holds;
- `stateful`: the protocol keeps server-side conversations (`previous_response_id`): the
  relay resolves `previous_id` to the stored history before translating, and stores
  `stored_state` with the call for the requests that continue it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from gateway.protocols.errors import GatewayError

if TYPE_CHECKING:  # the interface names the layout; only the protocols that resume import it
    from gateway.protocols.resumable import Layout

CHAT_PATH = "/v1/chat/completions"


class UpstreamContext(Protocol):
    """What answering one request needs to know of it; every protocol's has the model named."""

    @property
    def model(self) -> str: ...


RequestT = TypeVar("RequestT")
ContextT = TypeVar("ContextT", bound=UpstreamContext)


class Stream(ABC):
    """One streamed response: engine chunks in, the protocol's SSE bytes out."""

    __slots__ = ()

    @abstractmethod
    def feed(self, chunk: dict[str, Any]) -> bytes:
        """The events one engine chunk makes (b"" for none)."""

    @abstractmethod
    def close(self) -> bytes:
        """The events that end a stream the engine finished."""

    @abstractmethod
    def fail(self, err: GatewayError) -> bytes:
        """The events that end the stream with `err`, in the protocol's own error shape."""

    def response(self) -> dict[str, Any] | None:
        """The response object `close()` will send, for a stateful protocol to store before it
        goes out; None where the protocol stores none."""
        return None


class Adapter(ABC, Generic[RequestT, ContextT]):
    """One wire protocol. Implementations are stateless singletons (`ADAPTER` of each protocol
    module); the per-request state is the request and context values they return."""

    __slots__ = ()

    name: ClassVar[str]
    upstream_path: ClassVar[str] = CHAT_PATH
    normalises_messages: ClassVar[bool] = False
    passes_engine_ids: ClassVar[bool] = False
    stateful: ClassVar[bool] = False

    @abstractmethod
    def parse(self, raw: bytes, earlier: Iterable[Layout] = ()) -> tuple[RequestT, Layout | None]:
        """The checked request, decoded from an `earlier` request's layout (newest first) where
        it can be, and the body's own layout for the requests after it (None if it has none).
        Raises GatewayError for a request the protocol refuses."""

    def parse_request(self, raw: bytes) -> RequestT:
        """The checked request, decoded whole."""
        return self.parse(raw)[0]

    def previous_id(self, req: RequestT) -> str | None:
        """The stored response this request continues; only a stateful protocol has one."""
        return None

    @abstractmethod
    def to_upstream(
        self, req: RequestT, history: list[Any] | None = None
    ) -> tuple[dict[str, Any], ContextT]:
        """The engine's request body (the relay may change it further) and the context its
        answer is rendered with. `history`: the stored conversation of `previous_id`, None when
        there is none (a stateful protocol then refuses a request that names one)."""

    def stored_state(
        self, req: RequestT, ctx: ContextT, response: dict[str, Any] | bytes
    ) -> dict[str, Any]:
        """What to store with the call so a later request can continue from it; `response` is
        the response object sent (`from_upstream`'s bytes or `Stream.response()`). Called only
        for a stateful protocol."""
        raise TypeError(f"the {self.name} protocol keeps no conversation state")

    @abstractmethod
    def from_upstream(self, resp: dict[str, Any], ctx: ContextT) -> bytes:
        """The whole response body for the engine's whole response `resp`."""

    @abstractmethod
    def stream(self, ctx: ContextT) -> Stream:
        """A stream for one streamed response."""

    @abstractmethod
    def render_error(self, err: GatewayError) -> tuple[int, bytes]:
        """(HTTP status, body) of `err` in the protocol's error shape."""
