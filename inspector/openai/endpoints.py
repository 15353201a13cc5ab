"""vLLM's endpoint plugin (entry point ``vllm.endpoint_plugins``): the steering middleware, and the
routes under ``/inspector/v1``: the hooks the engine compiled, the captures of requests that asked, and
the named vectors (listed by anyone the server lets in; registered and removed with the token in
``INSPECTOR_ADMIN_TOKEN``)."""

from __future__ import annotations

import atexit
import hmac
import logging
import os
import shutil
import tempfile
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from inspector.core.hooks import HookPoint, check_patterns
from inspector.core.request_edits import SERVED_SECTION, decode_vector
from inspector.engine.tokens import token_text
from inspector.core.drained import drain_from_portable
from inspector.core.ranks import merge_descriptions, merge_ranks

from .admission import Admission
from .capture_store import CaptureStore, server_metadata
from .middleware import SteeringMiddleware
from .steering import HookTable
from .vectors import parse_vector_spec

TOKEN_ENV = "INSPECTOR_ADMIN_TOKEN"
TOKEN_HEADER = "x-inspector-token"
CAPTURE_STORE_MIB = 1024  # the cap of the capture files kept, unless the section's capture_store_mib says
logger = logging.getLogger(__name__)


class InspectorEndpoints:
    name = "activation_inspector"
    required_tasks = ("generate",)

    def __init__(self):
        self.admission = Admission()
        self.captures: CaptureStore | None = None

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter(prefix="/inspector/v1")
        router.add_api_route("/hooks", self.hooks, methods=["GET"])
        router.add_api_route("/captures", self.list_captures, methods=["GET"])
        router.add_api_route("/captures/{capture_id}", self.capture, methods=["GET"])
        router.add_api_route("/vectors", self.list_vectors, methods=["GET"])
        router.add_api_route("/vectors/{name}", self.put_vector, methods=["PUT"])
        router.add_api_route("/vectors/{name}", self.delete_vector, methods=["DELETE"])
        app.include_router(router)
        app.add_middleware(SteeringMiddleware, admission=self.admission, captures=lambda: self.captures)

    async def init_state(self, engine_client, state, args) -> None:
        """Ask the engine's worker what it compiled, and register the vectors named at start."""
        section = (getattr(state.vllm_config, "additional_config", None) or {}).get(SERVED_SECTION)
        if section is None or engine_client is None:
            logger.warning("the inspector's endpoints are loaded but --additional-config has no %r section: "
                           "this server steers nothing", SERVED_SECTION)
            return
        if (getattr(args, "api_server_count", None) or 1) > 1:
            raise ValueError("the inspector's endpoints need one API server process (--api-server-count 1): each "
                             "process would count the engine's slots and drain its rows as if it were alone")
        described = merge_descriptions(await engine_client.collective_rpc("inspector_describe"))
        hooks = HookTable.from_description(described)
        check_patterns(section.get("hooks", []), map(HookPoint.from_dict, described["hook_points"]))
        for text in section.get("vectors", []):
            spec = parse_vector_spec(text)
            self.admission.vectors.add(spec.name, hooks.installed(spec.hook), spec.vector, spec.source, hooks.widths,
                                       spec.clamp, spec.unclampable)
        tokenizer = engine_client.renderer.get_tokenizer()
        split = {name for name, point in hooks.points.items() if point.shards > 1}

        async def drain(wait: bool):
            replies = await engine_client.collective_rpc("inspector_drain", args=(wait, True))
            return merge_ranks([drain_from_portable(reply) for reply in replies], split)

        directory = section.get("capture_dir")
        if directory is None:  # a directory of this server's own, gone when it stops
            directory = tempfile.mkdtemp(prefix="inspector-captures-")
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
        self.captures = CaptureStore(Path(directory), int(section.get("capture_store_mib", CAPTURE_STORE_MIB)) << 20,
                                     hooks, server_metadata(state.vllm_config, hooks.mode), drain,
                                     lambda ids: [token_text(tokenizer, i) for i in ids])
        self.admission.hooks = hooks
        logger.info("inspector: steering %d compiled hooks, %d named vectors", len(hooks.points),
                    len(self.admission.vectors.summaries()))

    async def hooks(self) -> JSONResponse:
        if self.admission.hooks is None:
            return _error(503, "this server was started without the inspector's section in --additional-config")
        return JSONResponse(self.admission.hooks.describe())

    async def list_captures(self) -> JSONResponse:
        """The captures running and kept (what the desktop app watches)."""
        return JSONResponse({"captures": self.captures.listing() if self.captures else []})

    async def capture(self, capture_id: str) -> Response:
        """The capture file of a response that asked for one (its id, as the answer gave it); of one still
        running, its rows so far (header ``X-Inspector-Capture-State: running``)."""
        if self.captures and self.captures.running(capture_id):
            path = await self.captures.snapshot(capture_id)
            if path is not None and path.name.startswith("running-"):
                return FileResponse(path, media_type="application/x-hdf5", filename=f"{capture_id}.h5",
                                    headers={"X-Inspector-Capture-State": "running"})
        else:
            path = self.captures.path(capture_id) if self.captures else None
        if path is None:
            return _error(404, f"no capture of {capture_id!r}: it did not ask (inspector_capture) or "
                               "was evicted (the store keeps the newest up to its capture_store_mib)")
        return FileResponse(path, media_type="application/x-hdf5", filename=f"{capture_id}.h5")

    async def list_vectors(self) -> JSONResponse:
        return JSONResponse({"vectors": self.admission.vectors.summaries()})

    async def put_vector(self, name: str, request: Request) -> JSONResponse:
        """Register or replace ``name``: a JSON body ``{"hook": ..., "vector": BASE64 of float32}``."""
        refused = _unauthorised(request) or (None if self.admission.hooks else _error(503, "no hooks to steer"))
        if refused:
            return refused
        try:
            body = await request.json()
            if not isinstance(body, dict) or set(body) != {"hook", "vector"}:
                raise ValueError('the body must be {"hook": HOOK, "vector": BASE64 of float32}')
            hooks = self.admission.hooks
            hook = hooks.installed(str(body["hook"]))
            vector = decode_vector(str(body["vector"]), f"vector {name!r}")
            added = self.admission.vectors.add(name, hook, vector, "http", hooks.widths)
        except ValueError as e:
            return _error(400, str(e))
        return JSONResponse(added.summary())

    async def delete_vector(self, name: str, request: Request) -> Response:
        refused = _unauthorised(request)
        if refused:
            return refused
        try:
            self.admission.vectors.remove(name)
        except KeyError:
            return _error(404, f"no vector named {name!r} is registered")
        return Response(status_code=204)


def _unauthorised(request: Request) -> JSONResponse | None:
    token = os.environ.get(TOKEN_ENV)
    if not token:
        return _error(403, f"registering vectors over HTTP is off: start the server with {TOKEN_ENV} set, and send "
                           f"it in the {TOKEN_HEADER} header")
    if not hmac.compare_digest(request.headers.get(TOKEN_HEADER, "").encode(), token.encode()):
        return _error(403, f"the {TOKEN_HEADER} header does not hold this server's {TOKEN_ENV}")
    return None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "inspector", "param": None, "code": status}},
                        status_code=status)
