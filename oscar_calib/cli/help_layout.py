"""How `--help` reads: commands in the order a user meets them, options grouped in panels, flags without a type.

One table per concern, applied to the commands as typer built them (`UserOrderGroup`, the app's group class), so
the option definitions stay where they are and a new option simply lands in the default "Options" panel.
"""

from __future__ import annotations

from typer.core import TyperGroup

# The order of a first session: calibrate, measure, inspect, publish, fetch; then the zoo and the tools.
COMMAND_ORDER = ("run", "eval", "audit", "push", "pull", "zoo", "refit", "stats", "import", "export")

# command -> panel -> option names (the Python parameter names). Options not listed stay under "Options".
PANELS: dict[str, dict[str, tuple[str, ...]]] = {
    "run": {
        "Model and data": ("model", "revision", "model_id", "trust_remote_code", "dataset", "dataset_revision",
                           "dataset_config", "split", "text_column", "chat_template", "samples", "seq_len", "holdout_len",
                           "seed"),
        "Recipe": ("granularity", "value_target", "k_clip_grid", "v_clip_grid", "key_objective", "clip",
                   "center_keys", "center_values", "quantizer", "scale_dtype", "sink", "recent", "group_size"),
        "Output": ("out", "overwrite", "as_json"),
        "Scale": ("device", "dtype", "batch_size", "device_map", "max_memory", "offload_folder", "checkpoint_every",
                  "checkpoint", "resume", "shard"),
    },
    "eval": {
        "Model and data": ("model", "revision", "model_id", "artifact", "allow_other_model", "data", "calib_data",
                           "calib_samples", "context", "max_windows"),
        "Methods and probes": ("methods", "sink", "recent", "page_size", "generation_steps", "generation_windows",
                               "probes"),
        "Output": ("json_out", "plot", "as_json"),
        "Scale": ("device", "dtype", "batch_size"),
    },
    "audit": {
        "Model and data": ("model", "revision", "model_id", "allow_other_model", "data", "samples", "seq_len"),
        "Output": ("top", "plots", "as_json"),
        "Scale": ("device", "dtype"),
    },
}


class UserOrderGroup(TyperGroup):
    """Lists commands in `COMMAND_ORDER` (others after, as registered) and puts each command's options into its
    panels. Flags show no `<bool>` type: `--overwrite <bool>` read as if it took a value (`--overwrite true`)."""

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda n: rank.get(n, len(rank)))

    def get_params(self, ctx):
        return _flags_without_type(super().get_params(ctx))

    def get_command(self, ctx, cmd_name: str):
        cmd = super().get_command(ctx, cmd_name)
        if cmd is None or getattr(cmd, "_oscar_laid_out", False):
            return cmd
        panels = PANELS.get(cmd_name, {})
        for param in _flags_without_type(cmd.get_params(ctx)):  # get_params: --help included
            for panel, names in panels.items():
                if param.name in names:
                    param.rich_help_panel = panel
        cmd._oscar_laid_out = True
        return cmd


def _flags_without_type(params: list) -> list:
    """Flags (`--overwrite`, `--clip/--no-clip`, `--help`) show no `<bool>` type column."""
    for param in params:
        if getattr(param, "is_flag", False) and hasattr(param, "display_type_rich"):
            param.metavar = ""
    return params
