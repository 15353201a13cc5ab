#!/bin/sh
# Add Activation Inspector to the desktop's application menu, for the current user (XDG paths):
#   $XDG_DATA_HOME/applications/activation-inspector.desktop            (XDG_DATA_HOME: ~/.local/share)
#   $XDG_DATA_HOME/icons/hicolor/{256x256,scalable}/apps/activation-inspector.{png,svg}
#
#   packaging/install-desktop-entry.sh [PATH/TO/inspector]     install (default: `inspector` on PATH)
#   packaging/install-desktop-entry.sh --uninstall             remove what install wrote
#
# The launcher's absolute path goes into Exec=, so an app installed in a virtual environment starts
# from the menu without that environment being activated. Icons come from resources/icons next to this
# script, or else from the installed package (asked through the launcher's own Python).
set -eu

NAME=activation-inspector
here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
data=${XDG_DATA_HOME:-$HOME/.local/share}
apps=$data/applications
png_dir=$data/icons/hicolor/256x256/apps
svg_dir=$data/icons/hicolor/scalable/apps

refresh() {
    command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database -q "$apps" 2>/dev/null || true
    command -v gtk-update-icon-cache >/dev/null 2>&1 && gtk-update-icon-cache -q -t "$data/icons/hicolor" 2>/dev/null || true
}

if [ "${1:-}" = "--uninstall" ]; then
    rm -f "$apps/$NAME.desktop" "$png_dir/$NAME.png" "$svg_dir/$NAME.svg"
    refresh
    echo "removed $apps/$NAME.desktop and its icons"
    exit 0
fi
case "${1:-}" in -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac

launcher=${1:-$(command -v inspector || true)}
if [ -z "$launcher" ] || [ ! -x "$launcher" ]; then
    echo "error: no 'inspector' launcher found; install the wheel first, or pass its path" >&2
    echo "       (e.g. $0 ~/.venvs/inspector/bin/inspector)" >&2
    exit 1
fi
launcher=$(CDPATH= cd -- "$(dirname -- "$launcher")" && pwd)/$(basename -- "$launcher")

icons=$here/../resources/icons
if [ ! -f "$icons/$NAME-256.png" ]; then
    # No source checkout around: take the icons the installed package carries.
    python=$(sed -n '1s/^#! *//p' "$launcher")
    icons=$("$python" -c 'from inspector.core.resources import icon_path; print(icon_path().parent)') || {
        echo "error: cannot find the icons (no resources/icons next to $0, none in the installed package)" >&2
        exit 1
    }
fi

mkdir -p "$apps" "$png_dir" "$svg_dir"
cp "$icons/$NAME-256.png" "$png_dir/$NAME.png"
cp "$icons/$NAME.svg" "$svg_dir/$NAME.svg"
case "$launcher" in
    *[\"\`\$\\]*) echo "error: launcher path has a character a desktop entry cannot quote simply: $launcher" >&2
                exit 1 ;;
    *[[:space:]\'\<\>\~\|\&\;\*\?\#\(\)]*) exec_value="\"$launcher\"" ;;  # reserved: quote the argument
    *) exec_value=$launcher ;;
esac
tmp=$apps/.$NAME.desktop.tmp
sed_escape() { printf '%s' "$1" | sed 's/[|&]/\\&/g'; }
sed -e "s|^Exec=.*|Exec=$(sed_escape "$exec_value")|" -e "s|^TryExec=.*|TryExec=$(sed_escape "$launcher")|" \
    "$here/$NAME.desktop" > "$tmp"
mv "$tmp" "$apps/$NAME.desktop"
if command -v desktop-file-validate >/dev/null 2>&1; then
    desktop-file-validate "$apps/$NAME.desktop"
fi
refresh
echo "installed $apps/$NAME.desktop (Exec=$exec_value)"
