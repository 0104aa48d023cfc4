#!/bin/sh
# Render alertmanager.yml with the webhook URLs from the environment, then run a command.
#
#   render-config.sh TEMPLATE OUTPUT [COMMAND [ARGS...]]
#
# Alertmanager 0.25 expands no environment variables and has no webhook `url_file`, so the repo's
# alertmanager.yml carries placeholder URLs; this replaces
#   http://dualtrack-webhook.invalid/alerts   with $DUALTRACK_WEBHOOK_URL
#   http://dualtrack-webhook.invalid/critical with $DUALTRACK_CRITICAL_WEBHOOK_URL (default: $DUALTRACK_WEBHOOK_URL)
# writes OUTPUT and execs COMMAND (the compose service: /bin/alertmanager --config.file=OUTPUT ...).
# Used by the compose service and by stack.processes.render_alertmanager_config.
set -eu

if [ $# -lt 2 ]; then
    echo "usage: render-config.sh TEMPLATE OUTPUT [COMMAND [ARGS...]]" >&2
    exit 2
fi
template=$1
output=$2
shift 2

placeholder=http://dualtrack-webhook.invalid
default_url=${DUALTRACK_WEBHOOK_URL:-$placeholder/alerts}
critical_url=${DUALTRACK_CRITICAL_WEBHOOK_URL:-${DUALTRACK_WEBHOOK_URL:-$placeholder/critical}}

# Escape the characters sed treats specially in a replacement (the delimiter |, & and \).
sed_escape() {
    printf '%s' "$1" | sed -e 's/[\\|&]/\\&/g'
}

sed -e "s|$placeholder/alerts|$(sed_escape "$default_url")|" \
    -e "s|$placeholder/critical|$(sed_escape "$critical_url")|" \
    "$template" > "$output"

if [ $# -gt 0 ]; then
    exec "$@"
fi
