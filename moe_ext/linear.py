"""moe_ext.Linear: a dense layer with vLLM's online FP8 path (seed 002), so the
dense layers of an MoE model can share the experts' FP8 loading and kernels.
Without a quant_config it is a plain full-precision linear layer."""
import torch

from . import fp8_online
from .weight_loading import copy_checked


class Linear(torch.nn.Module):
    """y = x @ weight.T (+ bias); weight [output_size, input_size]."""

    def __init__(self, input_size, output_size, bias=False, params_dtype=None,
                 quant_config=None, prefix="", device=None):
        super().__init__()
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.input_size, self.output_size = input_size, output_size
        self.params_dtype = params_dtype
        self.quant_config = quant_config
        self.quant_method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self._fp8_ready = True
        if self.quant_method is None:
            self.weight = torch.nn.Parameter(
                torch.empty(output_size, input_size, dtype=params_dtype, device=device),
                requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        else:
            self.quant_method.create_weights(
                self, input_size_per_partition=input_size, output_partition_sizes=[output_size],
                input_size=input_size, output_size=output_size, params_dtype=params_dtype,
                weight_loader=self.weight_loader, device=device)
        if bias:
            self.bias = torch.nn.Parameter(torch.empty(output_size, dtype=params_dtype,
                                                       device=device), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None

    def weight_loader(self, param, loaded_weight, *unused_args, **unused_kwargs):
        """Copies a full checkpoint tensor into `param` (quantizing the weight of an FP8
        layer at once)."""
        if self.quant_method is not None and param is not self._parameters.get("bias"):
            return fp8_online.linear_weight_loader(self, param, loaded_weight)
        copy_checked(param.data, loaded_weight, "the Linear layer's "
                     + ("bias" if param is self._parameters.get("bias") else "weight"))

    def process_weights_after_loading(self):
        if self.quant_method is not None:
            self.quant_method.process_weights_after_loading(self)

    def forward(self, x):
        if self.quant_method is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        out = self.quant_method.apply(self, rows.contiguous(), self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def extra_repr(self):
        return (f"in_features={self.input_size}, output_size={self.output_size}, "
                f"bias={self.bias is not None}, quant_method="
                f"{type(self.quant_method).__name__ if self.quant_method else None}")
