"""A real ``aiomm serve`` app on loopback (uvicorn in a thread) for the model folder the golden
fixtures were recorded with, rebuilt offline (``tests/support/qwen2vl_folder.py``)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from aiomm.server import ServerConfig, create_app  # noqa: E402
from aiomm.server.runtime.protocol import RenderHttpProtocol  # noqa: E402

#: the path the fixtures' vLLM server was given: it is part of every mm_hash
RECORDED_MODEL = "/tmp/vllm-probe/qwen2vl"
#: the same for the Qwen2.5-VL video fixtures (``fixtures_qwen2_5_vl/``)
RECORDED_MODEL_QWEN2_5 = "/tmp/vllm-probe/qwen25vl"
#: the same for the Qwen3-VL video fixtures (``fixtures_qwen3_vl/``)
RECORDED_MODEL_QWEN3 = "/tmp/vllm-probe/qwen3vl"
#: the same for the GLM-4V video fixtures (``fixtures_glm4v/``)
RECORDED_MODEL_GLM4V = "/tmp/vllm-probe/glm4v"
#: the same for the GLM-OCR video fixtures (``fixtures_glm_ocr/``)
RECORDED_MODEL_GLM_OCR = "/tmp/vllm-probe/glmocr"
#: the same for the fixtures of the offline folders ``aiomm serve SHORT_NAME`` writes
#: (``aiomm.adapters.folders.write_model_folder``): Mistral 3 and Llama Nemotron VL (embed)
RECORDED_MODEL_MISTRAL3 = "/tmp/vllm-probe/mistral3"
RECORDED_MODEL_NEMOTRON_VL = "/tmp/vllm-probe/nemotron-embed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], deadline: float) -> None:
    """Wait until the server ``proc`` runs at ``url`` answers ``/health`` with 200, before the
    ``time.monotonic()`` ``deadline``; fail with its output if it exits first."""
    while True:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise AssertionError(f"{proc.args} exited:\n{out[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} did not answer /health")
        time.sleep(0.1)


class LiveServer:
    def __init__(self, config: ServerConfig) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(config),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                loop="asyncio",
                http=RenderHttpProtocol,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="session")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qwen2vl_folder import build_folder

    return build_folder(tmp_path_factory.mktemp("qwen2vl"))


@pytest.fixture(scope="module")
def live_server(
    model_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    media = tmp_path_factory.mktemp("media")
    config = ServerConfig(
        model=str(model_folder),
        model_id=RECORDED_MODEL,
        served_model_names=(RECORDED_MODEL,),
        allowed_local_media_path=str(media),
        encode_on_send=True,  # the items' base64 made as each response is sent
    )
    with LiveServer(config) as server:
        server.media = media  # type: ignore[attr-defined]
        yield server


def _served(folder: Path, recorded_model: str) -> Iterator[LiveServer]:
    """A live server for ``folder``, hashing items with the path vLLM was given (its items'
    base64 made whole in the encode threads, as on a host with many cores per process)."""
    config = ServerConfig(
        model=str(folder),
        model_id=recorded_model,
        served_model_names=(recorded_model,),
        encode_on_send=False,
    )
    with LiveServer(config) as server:
        yield server


def _registered_server(fixture: str, short_name: str, recorded_model: str) -> Any:
    """A module-scoped fixture named ``fixture``: a live server for the offline folder
    ``aiomm serve SHORT_NAME`` writes (``aiomm.adapters.folders.write_model_folder``), hashing
    items with ``recorded_model``, the path vLLM's render server was given for the fixtures."""

    def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
        from aiomm.adapters.folders import write_model_folder

        folder = write_model_folder(short_name, tmp_path_factory.mktemp(fixture))
        yield from _served(folder, recorded_model)

    return pytest.fixture(scope="module", name=fixture)(served)


@pytest.fixture(scope="module")
def live_server_qwen2_5(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server for the Qwen2.5-VL variant of the folder (``second_per_grid_ts``)."""
    from qwen2vl_folder import build_folder

    folder = build_folder(tmp_path_factory.mktemp("qwen25vl"), variant="qwen2_5_vl")
    yield from _served(folder, RECORDED_MODEL_QWEN2_5)


@pytest.fixture(scope="module")
def live_server_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server for the Qwen3-VL variant of the folder (timestamped video prompts)."""
    from qwen2vl_folder import build_folder

    folder = build_folder(tmp_path_factory.mktemp("qwen3vl"), variant="qwen3_vl")
    yield from _served(folder, RECORDED_MODEL_QWEN3)


@pytest.fixture(scope="module")
def live_server_glm4v(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server for the offline GLM-4.1V folder (``tests/support/glm4v_folder.py``)."""
    from glm4v_folder import build_glm4v_folder

    yield from _served(build_glm4v_folder(tmp_path_factory.mktemp("glm4v")), RECORDED_MODEL_GLM4V)


@pytest.fixture(scope="module")
def live_server_glm_ocr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server for the offline GLM-OCR folder (``tests/support/glm4v_folder.py``)."""
    from glm4v_folder import build_glm_ocr_folder

    folder = build_glm_ocr_folder(tmp_path_factory.mktemp("glm_ocr"))
    yield from _served(folder, RECORDED_MODEL_GLM_OCR)


live_server_mistral3 = _registered_server(
    "live_server_mistral3", "mistral3", RECORDED_MODEL_MISTRAL3
)


live_server_nemotron_vl = _registered_server(
    "live_server_nemotron_vl", "llama-nemotron-vl-embed", RECORDED_MODEL_NEMOTRON_VL
)


#: the path the Gemma 3 fixtures' vLLM server was given (``fixtures_gemma3/``, the folder
#: ``aiomm serve gemma3`` writes)
RECORDED_MODEL_GEMMA3 = "/tmp/vllm-probe/gemma3"


live_server_gemma3 = _registered_server("live_server_gemma3", "gemma3", RECORDED_MODEL_GEMMA3)


#: the path the InternVL fixtures' vLLM server was given (``fixtures_internvl/``)
RECORDED_MODEL_INTERNVL = "/tmp/vllm-probe/internvl"


live_server_internvl = _registered_server(
    "live_server_internvl", "internvl", RECORDED_MODEL_INTERNVL
)


#: the path the Llama 4 fixtures' vLLM server was given (``fixtures_llama4/``, the folder
#: ``aiomm serve llama4`` writes)
RECORDED_MODEL_LLAMA4 = "/tmp/vllm-probe/llama4"


live_server_llama4 = _registered_server("live_server_llama4", "llama4", RECORDED_MODEL_LLAMA4)


#: the path the LLaVA-NeXT fixtures' vLLM server was given (``fixtures_llava_next/``, recorded
#: for ``aiomm serve llava-next``'s folder)
RECORDED_MODEL_LLAVA_NEXT = "/tmp/vllm-probe/llava-next"


live_server_llava_next = _registered_server(
    "live_server_llava_next", "llava-next", RECORDED_MODEL_LLAVA_NEXT
)


#: the same for the LLaVA-OneVision fixtures (``fixtures_llava_onevision/``, recorded for
#: ``aiomm serve llava-onevision``'s folder)
RECORDED_MODEL_LLAVA_ONEVISION = "/tmp/vllm-probe/llava-onevision"


live_server_llava_onevision = _registered_server(
    "live_server_llava_onevision", "llava-onevision", RECORDED_MODEL_LLAVA_ONEVISION
)


#: the path the Idefics3 fixtures' vLLM server was given (``fixtures_idefics3/``, recorded for
#: ``aiomm serve idefics3``'s folder)
RECORDED_MODEL_IDEFICS3 = "/tmp/vllm-probe/idefics3"


live_server_idefics3 = _registered_server(
    "live_server_idefics3", "idefics3", RECORDED_MODEL_IDEFICS3
)


#: the path the PaddleOCR-VL fixtures' vLLM server was given (``fixtures_paddleocr_vl/``,
#: recorded for ``aiomm serve paddleocr-vl``'s folder)
RECORDED_MODEL_PADDLEOCR_VL = "/tmp/vllm-probe/paddleocr-vl"


live_server_paddleocr_vl = _registered_server(
    "live_server_paddleocr_vl", "paddleocr-vl", RECORDED_MODEL_PADDLEOCR_VL
)


#: the path the SmolVLM fixtures' vLLM server was given (``fixtures_smolvlm/``, recorded for
#: ``aiomm serve smolvlm``'s folder)
RECORDED_MODEL_SMOLVLM = "/tmp/vllm-probe/smolvlm"


live_server_smolvlm = _registered_server("live_server_smolvlm", "smolvlm", RECORDED_MODEL_SMOLVLM)


#: the path the Gemma 4 fixtures' vLLM server was given (``fixtures_gemma4/``, recorded for
#: ``aiomm serve gemma4``'s folder)
RECORDED_MODEL_GEMMA4 = "/tmp/vllm-probe/gemma4"


live_server_gemma4 = _registered_server("live_server_gemma4", "gemma4", RECORDED_MODEL_GEMMA4)


#: the path the DeepSeek-OCR 2 fixtures' vLLM server was given (``fixtures_deepseek_ocr2/``,
#: recorded for ``aiomm serve deepseek-ocr-2``'s folder)
RECORDED_MODEL_DEEPSEEK_OCR2 = "/tmp/vllm-probe/deepseek-ocr-2"


live_server_deepseek_ocr2 = _registered_server(
    "live_server_deepseek_ocr2", "deepseek-ocr-2", RECORDED_MODEL_DEEPSEEK_OCR2
)


#: the path the DeepSeek-OCR fixtures' vLLM server was given (``fixtures_deepseek_ocr/``,
#: recorded for ``aiomm serve deepseek-ocr``'s folder)
RECORDED_MODEL_DEEPSEEK_OCR = "/tmp/vllm-probe/deepseek-ocr"


live_server_deepseek_ocr = _registered_server(
    "live_server_deepseek_ocr", "deepseek-ocr", RECORDED_MODEL_DEEPSEEK_OCR
)


#: the path the Qwen2-Audio fixtures' vLLM server was given (``fixtures_qwen2_audio/``,
#: recorded for ``aiomm serve qwen2-audio``'s folder)
RECORDED_MODEL_QWEN2_AUDIO = "/tmp/vllm-probe/qwen2-audio"


live_server_qwen2_audio = _registered_server(
    "live_server_qwen2_audio", "qwen2-audio", RECORDED_MODEL_QWEN2_AUDIO
)


#: the path the Qwen2.5-Omni fixtures' vLLM server was given (``fixtures_qwen2_5_omni/``,
#: recorded for ``aiomm serve qwen2.5-omni``'s folder)
RECORDED_MODEL_QWEN2_5_OMNI = "/tmp/vllm-probe/qwen2.5-omni"


live_server_qwen2_5_omni = _registered_server(
    "live_server_qwen2_5_omni", "qwen2.5-omni", RECORDED_MODEL_QWEN2_5_OMNI
)


#: the path the Kimi-K2.5 fixtures' vLLM server was given (``fixtures_kimi_k25/``, recorded for
#: ``aiomm serve kimi-k2.5``'s folder with the processor cache off)
RECORDED_MODEL_KIMI_K25 = "/tmp/vllm-probe/kimi-k2.5"


@pytest.fixture(scope="module")
def live_server_kimi_k25(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server for ``aiomm serve kimi-k2.5``'s folder with no item cache, as vLLM's was run for
    the fixtures (it then names items by request-counter ids)."""
    from aiomm.adapters.folders import write_model_folder

    folder = write_model_folder("kimi-k2.5", tmp_path_factory.mktemp("live_server_kimi_k25"))
    config = ServerConfig(
        model=str(folder),
        model_id=RECORDED_MODEL_KIMI_K25,
        served_model_names=(RECORDED_MODEL_KIMI_K25,),
        encode_on_send=False,
        cache_bytes=0,
    )
    with LiveServer(config) as server:
        yield server


#: the path the Qwen3-Omni fixtures' vLLM server was given (``fixtures_qwen3_omni/``, recorded
#: for ``aiomm serve qwen3-omni``'s folder)
RECORDED_MODEL_QWEN3_OMNI = "/tmp/vllm-probe/qwen3-omni"


live_server_qwen3_omni = _registered_server(
    "live_server_qwen3_omni", "qwen3-omni", RECORDED_MODEL_QWEN3_OMNI
)
