"""Expert placement for expert parallelism: which global experts live on which rank."""
import torch

PLACEMENT_STRATEGIES = ("linear", "round_robin")


def _check(ep_size, ep_rank, global_num_experts, expert_placement_strategy):
    if ep_size < 1:
        raise ValueError(f"ep_size: expected >= 1, got {ep_size}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank: expected 0 <= ep_rank < {ep_size}, got {ep_rank}")
    if global_num_experts < 1:
        raise ValueError(f"global_num_experts: expected >= 1, got {global_num_experts}")
    if expert_placement_strategy not in PLACEMENT_STRATEGIES:
        raise ValueError("expert_placement_strategy: expected 'linear' or 'round_robin', "
                         f"got {expert_placement_strategy!r}")


def local_expert_ids(ep_size, ep_rank, global_num_experts, expert_placement_strategy="linear"):
    """Global ids of the experts on `ep_rank`, in local order."""
    _check(ep_size, ep_rank, global_num_experts, expert_placement_strategy)
    if expert_placement_strategy == "round_robin":
        return list(range(ep_rank, global_num_experts, ep_size))
    base, remainder = divmod(global_num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, remainder)
    return list(range(start, start + base + (1 if ep_rank < remainder else 0)))


def determine_expert_map(ep_size, ep_rank, global_num_experts,
                         expert_placement_strategy="linear", num_fused_shared_experts=0,
                         return_expert_mask=False):
    """vLLM's determine_expert_map: (local_num_experts, expert_map, expert_mask).

    Experts are spread evenly over the ranks, the remainder one each to the lowest
    ranks ("linear"), or global expert e goes to rank e % ep_size ("round_robin").
    expert_map is an int32 tensor of global -> local id, -1 for experts on other
    ranks; it is None (and local_num_experts is global_num_experts) when
    ep_size == 1. expert_mask (ROCm aiter only in vLLM) is always None here.
    """
    if num_fused_shared_experts:
        raise NotImplementedError("num_fused_shared_experts: fused shared experts (ROCm aiter) "
                                  "are not supported")
    if return_expert_mask:
        raise NotImplementedError("return_expert_mask: the aiter expert mask is not supported")
    _check(ep_size, ep_rank, global_num_experts, expert_placement_strategy)
    if ep_size == 1:
        return global_num_experts, None, None
    local = local_expert_ids(ep_size, ep_rank, global_num_experts, expert_placement_strategy)
    expert_map = torch.full((global_num_experts,), -1, dtype=torch.int32)
    expert_map[torch.tensor(local, dtype=torch.long)] = torch.arange(len(local), dtype=torch.int32)
    return len(local), expert_map, None
