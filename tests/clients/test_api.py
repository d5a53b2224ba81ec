"""The API's conventions, without a server: what every docstring states, keyword-only mask
arguments, the alias package."""
import inspect

import attnserve
import attnserve_client


def methods_with(param):
    for cls in (attnserve.Client, attnserve.AsyncClient):
        for name, method in inspect.getmembers(cls, callable):
            if not name.startswith("_") and param in inspect.signature(method).parameters:
                yield f"{cls.__name__}.{name}", method


def test_every_causal_docstring_states_bottom_right():
    found = list(methods_with("causal"))
    assert len(found) == 8  # attend, attend_varlen, backward, backward_varlen, both clients
    found += [(f"{cls.__name__}.attend_many", cls.attend_many)  # takes causal in its problems
              for cls in (attnserve.Client, attnserve.AsyncClient)]
    for name, method in found:
        doc = " ".join(inspect.getdoc(method).split())
        assert "bottom-right" in doc and "i + seqlen_k - seqlen_q" in doc, name


def test_lse_shape_is_documented():
    for name, method in methods_with("return_lse"):
        doc = " ".join(inspect.getdoc(method).split())
        assert "[batch, heads, seqlen_q]" in doc or "[heads, total_q]" in doc, name
        assert "natural log" in doc, name


def test_mask_arguments_are_keyword_only():
    for name, method in methods_with("softmax_scale"):
        kind = inspect.signature(method).parameters["softmax_scale"].kind
        assert kind is inspect.Parameter.KEYWORD_ONLY, name


def test_alias_package():
    assert attnserve_client.Client is attnserve.Client
    assert attnserve_client.AttnServeError is attnserve.AttnServeError
