"""Configuration of a Pythia / GPT-NeoX style causal LM with distance-aware attention."""

from transformers import PretrainedConfig

from .attention import ATTENTION_VARIANTS, KERNELS
from .variants import DEFAULT_BOTTLENECK, check_values


class DimAttnConfig(PretrainedConfig):
    """Pythia hyperparameters plus the attention variant of seeds 000 and 001.

    attention: a key of ``ATTENTION_VARIANTS``: "vanilla", "dar", "uniform", "swa", "dilated".
    window: the number of recent positions (distance i - j < window, the token itself included)
        that DAR keeps full-dimensional and that SWA and dilated attention see. Seed 001's
        ``window_size=W`` keeps W + 1 tokens, so it is ``window=W + 1`` here.
    d_down: bottleneck width of W_down (d x d_down) and W_up (d_down x d) for distant tokens.
    bottleneck_activation: "linear" (seed 000's choice) or "sigmoid", applied after W_down.
    dilation: r of dilated attention: beyond the window, keys at positions 0, r, 2r, ...
    full_attention_every: N turns every N-th layer (layers N-1, 2N-1, ...) into full vanilla
        attention: seed 001's "Combined Sliding + Full" with attention="swa".
    attention_layers: the layers that use ``attention``; the others are vanilla (for example
        DAR on a chosen subset of layers). None: every layer.
    attention_kernel: "auto", "dense", "blocked" or "flex" (see ``dimattn.model.attention``).
    """

    model_type = "dimattn"

    def __init__(
        self,
        vocab_size: int = 50304,
        hidden_size: int = 512,
        num_hidden_layers: int = 6,
        num_attention_heads: int = 8,
        intermediate_size: int | None = None,
        hidden_act: str = "gelu",
        rotary_pct: float = 0.25,
        rotary_emb_base: float = 10000.0,
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        layer_norm_eps: float = 1e-5,
        use_parallel_residual: bool = True,
        attention: str = "vanilla",
        window: int = 128,
        d_down: int | None = None,
        bottleneck_activation: str = DEFAULT_BOTTLENECK,
        dilation: int = 4,
        full_attention_every: int | None = None,
        attention_layers: list[int] | None = None,
        attention_kernel: str = "auto",
        bos_token_id: int | None = 0,
        eos_token_id: int | None = 0,
        pad_token_id: int | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.hidden_act = hidden_act
        self.rotary_pct = rotary_pct
        self.rotary_emb_base = rotary_emb_base
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.layer_norm_eps = layer_norm_eps
        self.use_parallel_residual = use_parallel_residual
        self.attention = attention
        self.window = window
        self.d_down = d_down
        self.bottleneck_activation = bottleneck_activation
        self.dilation = dilation
        self.full_attention_every = full_attention_every
        self.attention_layers = list(attention_layers) if attention_layers is not None else None
        self.attention_kernel = attention_kernel
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.validate_dimattn()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def layer_attention(self, layer_idx: int) -> str:
        """The variant layer ``layer_idx`` runs: ``attention`` unless the layer pattern makes it
        a full-attention layer."""
        if self.attention_layers is not None and layer_idx not in self.attention_layers:
            return "vanilla"
        every = self.full_attention_every
        if every and (layer_idx + 1) % every == 0:
            return "vanilla"
        return self.attention

    @property
    def uses_bottleneck(self) -> bool:
        return any(ATTENTION_VARIANTS[self.layer_attention(i)].far for i in range(self.num_hidden_layers))

    def validate_dimattn(self) -> None:
        """The checks of the sweeps (dimattn.model.variants), so a config error reads the same whether
        it comes from a config.yaml or from Python; plus the kernel, which sweeps never set."""
        errors = check_values({k: getattr(self, k) for k in _CHECKED})
        if errors:
            key, message = errors[0]
            raise ValueError(f"{key}: {message}")
        if self.attention_kernel not in KERNELS:
            raise ValueError(f"attention_kernel={self.attention_kernel!r}; choose one of {KERNELS}")


_CHECKED = ("attention", "hidden_size", "num_attention_heads", "num_hidden_layers", "window", "d_down",
            "bottleneck_activation", "dilation", "full_attention_every", "attention_layers")
