"""OpenAI's Responses API routes (behind the API key when keys are set, as every /v1/
route), served by the ResponsesService (serve_app/openai/responses/service.py) of the model
a request names, from the FastAPI app's state. A stored response is any model's to read (they
share the app's store)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from serve_app.openai.responses.protocol import ResponsesRequest

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    served = await request.app.state.models.pick(body.model)
    return await served.responses.create(body)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    return await request.app.state.models.first.responses.get(response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def response_input_items(response_id: str, request: Request) -> Response:
    return await request.app.state.models.first.responses.input_items(response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    return await request.app.state.models.first.responses.delete(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    return await request.app.state.models.first.responses.cancel(response_id)
