"""Which served model an OpenAI request's `model` means.

Two rules, both from the servers clients are written against: a name the operator maps
(`--http-model-aliases gpt-4o=smollm2`: programs that hard-code a vendor's model name run
unchanged), and an omitted `model` meaning the one served model of the endpoint's kind
(vLLM and llama-server serve their one model the same way). With none or several of that
kind, the request is refused 400 naming `model` and listing what is served.
"""

from __future__ import annotations

from typing import Any

from common import model_keys
from common.errors import MeshError
from router.http.errors import HttpError
from router.mesh import MeshApi
from router.tenancy.auth import Tenant

LLM, EMBED = "llm", "embed"  # the kinds an endpoint serves


def parse_aliases(text: str) -> dict[str, str]:
    """`alias=model,alias2=model` (the setting's spelling) as a dict."""
    aliases = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        alias, sep, model = item.partition("=")
        if not sep or not alias.strip() or not model.strip():
            raise ValueError(f"http model alias {item!r}: alias=model expected")
        aliases[alias.strip()] = model.strip()
    return aliases


class ModelNames:
    def __init__(self, mesh: MeshApi, aliases: dict[str, str]) -> None:
        self.mesh = mesh
        self.aliases = aliases
        self._kinds: dict[str, str] = {}  # a served name's kind, read once from its config

    async def resolve(self, doc: Any, kind: str, tenant: Tenant | None) -> None:
        """Set `doc["model"]` to the served name it means (a non-dict body is left to the
        endpoint's parser, which refuses it)."""
        if not isinstance(doc, dict):
            return
        name = doc.get("model")
        if name is None:
            doc["model"] = await self._default(kind, tenant)
        elif isinstance(name, str) and name in self.aliases:
            doc["model"] = self.aliases[name]

    async def _default(self, kind: str, tenant: Tenant | None) -> str:
        names = sorted({m.name for m in self.mesh.repository_index(tenant).models})
        found = [n for n in names if await self._kind(n, tenant) == kind]
        if len(found) != 1:
            what = "none" if not found else f"several: {found[:8]}"
            raise HttpError(400, f"model: required (served {kind} models: {what})", "model")
        return found[0]

    async def _kind(self, name: str, tenant: Tenant | None) -> str:
        if name not in self._kinds:
            try:
                reply = await self.mesh.model_config(tenant, name, "")
            except MeshError:
                return ""  # not answering now: not a default, asked again next time
            params = {k: v.string_value for k, v in reply.config.parameters.items()}
            if params.get(model_keys.ENGINE) == model_keys.LLM_ENGINE:
                self._kinds[name] = LLM
            else:
                self._kinds[name] = EMBED if params.get(model_keys.TEXT_TASK) == EMBED else ""
        return self._kinds[name]
