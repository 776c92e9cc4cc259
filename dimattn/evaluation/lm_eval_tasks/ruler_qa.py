"""lm-eval's RULER QA tasks (``ruler_qa_squad``, ``ruler_qa_hotpot``) reading SQuAD and HotpotQA
from files instead of the network.

Why: lm-eval's ``lm_eval.tasks.ruler.qa_utils`` fetches both JSON files with ``requests`` and
keeps them in memory only (``functools.cache``), so no cache a download rule fills can serve an
offline compute node (``ConnectionError ... rajpurkar.github.io``). The ``prefetch`` rule saves
them with :func:`fetch` under the Hugging Face home (shared by the login and the compute nodes,
as the hub cache is); these tasks, which override lm-eval's of the same names through the
include path (TASKS_DIR of dimattn.evaluation.scoring), hand lm-eval's own readers and sample generator that
file. Same URLs (lm-eval's own defaults), same data, same samples.
"""

import hashlib
import inspect
import json
import os
from pathlib import Path

from lm_eval.tasks.ruler import qa_utils
from lm_eval.tasks.ruler.common_utils import aggregate_metrics, process_results_part  # noqa: F401 (the yamls')

# lm-eval's own pinned URLs, read off its readers' defaults so that an lm-eval upgrade moves both.
URLS = {
    name: inspect.signature(reader).parameters["url"].default
    for name, reader in (("squad", qa_utils.read_squad), ("hotpotqa", qa_utils.read_hotpotqa))
}


def local_path(url: str) -> Path:
    from huggingface_hub.constants import HF_HOME

    return Path(HF_HOME) / "dimattn" / "ruler_qa" / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{Path(url).name}"


def source_url(url: str) -> str:
    """A huggingface.co URL through HF_ENDPOINT (a site's mirror, the rehearsal's hub), as
    huggingface_hub resolves the hub's own files; any other as it is."""
    from huggingface_hub import constants

    hub = "https://huggingface.co/"
    return constants.ENDPOINT.rstrip("/") + "/" + url[len(hub):] if url.startswith(hub) else url


def fetch(sources: dict[str, str | None] | None = None) -> dict[str, str]:
    """Download both files once (on a machine with network: the prefetch rule); {name: path}.
    ``sources`` ({"squad" or "hotpotqa": URL}, dimpo.downstream.ruler_qa_sources) fetch a file
    from elsewhere; it is kept under lm-eval's URL, the one the compute jobs' tasks ask for."""
    import requests

    done = {}
    for name, url in URLS.items():
        path = local_path(url)
        if not path.is_file():
            response = requests.get(source_url((sources or {}).get(name) or url), timeout=600)
            response.raise_for_status()
            json.loads(response.content)  # a truncated or HTML answer is refused before it is kept
            path.parent.mkdir(parents=True, exist_ok=True)
            # A temp sibling renamed into place, as dimattn.model.atomic does (lm-eval loads this file on
            # its own, without the dimattn package): a killed download leaves no half file.
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(response.content)
            os.replace(tmp, path)
        done[name] = str(path)
    return done


def read_local(url: str) -> dict:
    """What lm-eval's download_json returns, from the prefetched file."""
    path = local_path(url)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} (RULER QA's {url}) is missing: run the prefetch rule on a machine with network first"
        )
    with open(path) as f:
        return json.load(f)


def _dataset(name: str, **kwargs):
    # lm-eval's readers call the module's download_json by name at call time.
    qa_utils.download_json = read_local
    return qa_utils.get_qa_dataset(name, **kwargs)


def get_squad(**kwargs):
    return _dataset("squad", **kwargs)


def get_hotpotqa(**kwargs):
    return _dataset("hotpotqa", **kwargs)
