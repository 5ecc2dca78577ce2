import pytest

from specport.core.errors import ProviderError
from specport.runtime import providers


def test_cpu_is_always_available():
    assert "cpu" in providers.available()
    assert providers.resolve("cpu") == ["CPUExecutionProvider"]


def test_auto_picks_an_installed_provider():
    chosen = providers.resolve("auto")
    assert chosen[-1] == "CPUExecutionProvider"


def test_unknown_provider_lists_choices():
    with pytest.raises(ProviderError, match="unknown provider 'tpu'.*cpu"):
        providers.resolve("tpu")


@pytest.mark.parametrize("name", ["cuda", "cann"])
def test_missing_provider_says_what_is_installed(name):
    if name in providers.available():
        pytest.skip(f"{name} is installed here")
    with pytest.raises(ProviderError, match="not available.*installed: cpu"):
        providers.resolve(name)
