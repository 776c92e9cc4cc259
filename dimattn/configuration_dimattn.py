"""Configuration of a Pythia / GPT-NeoX style causal LM with distance-aware attention."""

from transformers import PretrainedConfig

from .attention import ATTENTION_VARIANTS


class DimAttnConfig(PretrainedConfig):
    """Pythia hyperparameters plus the attention variant of seeds 000 and 001.

    attention: a key of ``ATTENTION_VARIANTS`` ("vanilla", "dar", "uniform").
    window: w of seed 000, the number of recent positions (distance i - j < w) that keep
        full-dimensional keys and values. Ignored by "vanilla" and "uniform".
    d_down: bottleneck width of W_down (d x d_down) and W_up (d_down x d) for distant tokens.
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

    @property
    def uses_bottleneck(self) -> bool:
        return ATTENTION_VARIANTS[self.attention].far

    def validate_dimattn(self) -> None:
        if self.attention not in ATTENTION_VARIANTS:
            raise ValueError(
                f"attention={self.attention!r} is not a known variant; choose one of {sorted(ATTENTION_VARIANTS)}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.uses_bottleneck:
            if self.d_down is None or not 0 < self.d_down <= self.hidden_size:
                raise ValueError(
                    f"d_down={self.d_down} must satisfy 0 < d_down <= hidden_size={self.hidden_size} "
                    f"for attention={self.attention!r}"
                )
