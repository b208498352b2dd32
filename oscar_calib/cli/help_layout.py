"""How `--help` reads: commands in the order a user meets them, every option in a named panel, flags without a type,
advanced panels behind `--help-all`.

One table per concern, applied to the commands as typer built them (`UserOrderGroup`, the app's group class), so
the option definitions stay where they are. A new option must be given a panel here: tests/test_help_layout.py
fails on an option left in typer's unnamed "Options" panel.
"""

from __future__ import annotations

import copy

from typer.core import TyperGroup

# The order of a first session: calibrate, measure, inspect, publish, fetch; then the zoo and the tools.
COMMAND_ORDER = ("run", "eval", "audit", "push", "pull", "zoo", "refit", "stats", "import", "export")

_RECIPE = ("granularity", "value_target", "k_clip_grid", "v_clip_grid", "key_objective", "clip", "centered",
           "quantizer", "scale_dtype", "hadamard_key_mass", "sink", "recent", "group_size")

# command ("zoo list" for a sub-command) -> panel -> option names (the Python parameter names), panels in the order
# they are shown. `--help` (and `--help-all`) go in the last panel `--help` shows.
PANELS: dict[str, dict[str, tuple[str, ...]]] = {
    "run": {
        "Model and data": ("model", "revision", "dataset", "dataset_revision", "split", "text_column", "samples",
                           "seq_len"),
        "Output": ("out", "overwrite", "as_json"),
        "More model and data": ("dataset_config", "holdout_len", "seed", "chat_template", "trust_remote_code"),
        "Recipe": _RECIPE,
        "Scale": ("device", "dtype", "batch_size", "device_map", "max_memory", "offload_folder", "checkpoint_every",
                  "checkpoint", "resume", "shard"),
    },
    "eval": {
        "Model and data": ("model", "revision", "model_id", "artifact", "allow_other_model", "data", "calib_data",
                           "calib_samples", "context", "max_windows"),
        "Methods and probes": ("methods", "sink", "recent", "page_size", "generation_steps", "generation_windows",
                               "probes"),
        "Scale": ("device", "dtype", "batch_size"),
        "Output": ("json_out", "plot", "as_json"),
    },
    "audit": {
        "Model and data": ("model", "revision", "model_id", "allow_other_model", "data", "samples", "seq_len"),
        "Scale": ("device", "dtype"),
        "Output": ("top", "plots", "as_json"),
    },
    "push": {
        "Release": ("repo", "repo_type", "version", "calibration", "include_stats", "with_wheels", "private",
                    "commit_message"),
        "Run": ("dry_run", "allow_unchanged", "token", "as_json"),
    },
    "pull": {
        "Release": ("repo", "repo_type", "revision", "calibration"),
        "Pins and checks": ("commit", "expected_sha256", "manifest", "model_config"),
        "Output": ("local_dir", "cache_dir", "token", "as_json"),
    },
    "zoo validate": {"Manifest": ("manifest", "offline", "token"), "Output": ("as_json",)},
    "zoo build": {"Manifest": ("manifest", "local_model", "device"), "Output": ("out_root", "overwrite", "as_json")},
    "zoo publish": {"Manifest": ("manifest", "out_root"),
                    "Hub": ("repo", "repo_type", "private", "commit_message", "dry_run", "token"),
                    "Output": ("as_json",)},
    "zoo list": {"Zoo": ("repo", "manifest", "repo_type", "token"), "Output": ("as_json",)},
    "zoo schema": {"Output": ("write",)},
    "refit": {"Recipe": _RECIPE, "Output": ("out", "overwrite", "device", "as_json")},
    "stats merge": {"Output": ("out", "overwrite", "as_json")},
    "import": {"Reference files and model": ("keys", "values", "model_config", "model_id", "model_revision"),
               "Format": ("k_clip", "v_clip", "sink", "recent"),
               "Output": ("out", "overwrite", "as_json")},
    "export": {"Format": ("fmt", "head_reduce", "reference_version"),
               "Model": ("model_config", "allow_other_model"),
               "Output": ("out", "overwrite", "as_json")},
}

# Panels `--help` leaves out (`--help-all` shows them): `run --help` fits two 80 x 50 screens with the rest hidden.
ADVANCED: dict[str, tuple[str, ...]] = {"run": ("More model and data", "Recipe", "Scale")}

HELP_ALL = "--help-all"


def panels_of(group_name: str | None, cmd_name: str) -> dict[str, tuple[str, ...]]:
    """The panel table of a command (`zoo list` is looked up under its group's name)."""
    return PANELS.get(f"{group_name} {cmd_name}", PANELS.get(cmd_name, {}))


class UserOrderGroup(TyperGroup):
    """Lists commands in `COMMAND_ORDER` (others after, as registered), puts each command's options into their
    panels in the table's order, and hides the advanced panels behind `--help-all`. Flags show no `<bool>` type:
    `--overwrite <bool>` read as if it took a value (`--overwrite true`); repeatable options show the element type
    (`<str>`), not `<list[str]>`."""

    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
        return sorted(names, key=lambda n: rank.get(n, len(rank)))

    def get_params(self, ctx):
        return _plain_metavars(super().get_params(ctx), ctx)

    def get_command(self, ctx, cmd_name: str):
        cmd = super().get_command(ctx, cmd_name)
        if cmd is None or getattr(cmd, "_oscar_laid_out", False) or hasattr(cmd, "list_commands"):
            return cmd
        key = f"{self.name} {cmd_name}" if f"{self.name} {cmd_name}" in PANELS else cmd_name
        _lay_out(cmd, ctx, panels_of(self.name, cmd_name), ADVANCED.get(key, ()))
        cmd._oscar_laid_out = True
        return cmd


def _lay_out(cmd, ctx, panels: dict[str, tuple[str, ...]], advanced: tuple[str, ...]) -> None:
    """Give each option its panel, order the options panel by panel, hide the advanced ones behind --help-all."""
    if not panels:
        return
    order = list(panels)
    shown = [panel for panel in order if panel not in advanced]
    panel_of = {name: panel for panel, names in panels.items() for name in names}
    if advanced:
        cmd.params.append(_help_all_option(cmd, ctx, advanced))
    for param in _plain_metavars(cmd.get_params(ctx), ctx):  # get_params: --help included
        if param.param_type_name != "option":
            continue
        panel = panel_of.get(param.name, shown[-1] if param.name in ("help", "help_all") else None)
        if panel is None:
            continue  # left in "Options": the test names it
        param.rich_help_panel = panel
        if panel in advanced:
            param.hidden = True
            param._oscar_advanced = True
    cmd.params.sort(key=lambda p: order.index(p.rich_help_panel) if getattr(p, "rich_help_panel", None) in order
                    else -1)


def _help_all_option(cmd, ctx, advanced: tuple[str, ...]):
    """`--help-all`: `--help` with the advanced panels shown. A copy of the command's own help option (a typer
    option, so that rich lays it out like the others) with its own name and callback."""
    option = copy.copy(cmd.get_help_option(ctx))
    option.opts, option.secondary_opts, option.name = [HELP_ALL], [], "help_all"
    option.help = f"Show every option, also the panels {', '.join(advanced)}, and exit."

    def show_all(ctx, param, value) -> None:
        if not value or ctx.resilient_parsing:
            return
        for p in ctx.command.params:
            if getattr(p, "_oscar_advanced", False):
                p.hidden = False
        from oscar_calib.cli.output import Output

        Output().result(ctx.get_help(), end="")
        ctx.exit()

    option.callback = show_all
    return option


def _plain_metavars(params: list, ctx) -> list:
    """Flags (`--overwrite`, `--clip/--no-clip`, `--help`) show no type column; a repeatable option or a variadic
    argument shows its element type, `<str>` rather than `<list[str]>` (its help says it repeats)."""
    for param in params:
        if getattr(param, "is_flag", False) and hasattr(param, "display_type_rich"):
            param.metavar = ""
        elif hasattr(param, "display_type"):
            shown = param.display_type(ctx)
            if not (shown and shown.startswith("<list[") and shown.endswith("]>")):
                continue
            element = "<" + shown[len("<list["):-len("]>")].lower() + ">"
            if param.param_type_name == "option":
                param.metavar = param.metavar or element
            else:  # an argument's metavar is its name column: replace only what the type column shows
                param.display_type_rich = lambda ctx, element=element: element
    return params
