#!/bin/sh
# Render alertmanager.yml with the webhook URLs and notification channels from the environment,
# then run a command.
#
#   render-config.sh TEMPLATE OUTPUT [COMMAND [ARGS...]]
#
# Alertmanager 0.25 expands no environment variables and has no webhook `url_file`, so the repo's
# alertmanager.yml carries placeholder URLs; this replaces
#   http://dualtrack-webhook.invalid/alerts   with $DUALTRACK_WEBHOOK_URL
#   http://dualtrack-webhook.invalid/critical with $DUALTRACK_CRITICAL_WEBHOOK_URL (default: $DUALTRACK_WEBHOOK_URL)
# adds the channels named in $DUALTRACK_CHANNELS (space- or comma-separated: slack pagerduty email
# msteams; alertmanager/channels/NAME.yml) to both receivers, leaving the webhook out when channels are
# set and no webhook URL is, and fills in the channels' settings:
#   $DUALTRACK_ALERTMANAGER_SECRETS    directory of the channels' secret files (/etc/dualtrack/secrets/notify)
#   $DUALTRACK_ALERTMANAGER_TEMPLATES  directory of dualtrack.tmpl (default: templates/ next to this script)
#   $DUALTRACK_EMAIL_TO, $DUALTRACK_EMAIL_FROM, $DUALTRACK_SMTP_SMARTHOST (host:port),
#   $DUALTRACK_SMTP_USERNAME, $DUALTRACK_SMTP_REQUIRE_TLS (true), $DUALTRACK_PAGERDUTY_URL (Events API v2)
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
here=$(cd "$(dirname "$0")" && pwd)

placeholder=http://dualtrack-webhook.invalid
default_url=${DUALTRACK_WEBHOOK_URL:-$placeholder/alerts}
critical_url=${DUALTRACK_CRITICAL_WEBHOOK_URL:-${DUALTRACK_WEBHOOK_URL:-$placeholder/critical}}
channels=$(printf '%s' "${DUALTRACK_CHANNELS:-}" | tr ',' ' ')

# Escape the characters sed treats specially in a replacement (the delimiter |, & and \).
sed_escape() {
    printf '%s' "$1" | sed -e 's/[\\|&]/\\&/g'
}

# A sed script: the URLs and the templates' directory; one `r FILE` per channel after each channels
# line; without a webhook URL, the channels replace the webhook.
script=$(mktemp)
trap 'rm -f "$script"' EXIT
{
    printf 's|%s|%s|\n' "$placeholder/alerts" "$(sed_escape "$default_url")"
    printf 's|%s|%s|\n' "$placeholder/critical" "$(sed_escape "$critical_url")"
    printf 's|/etc/alertmanager/templates/|%s/|\n' "$(sed_escape "${DUALTRACK_ALERTMANAGER_TEMPLATES:-$here/templates}")"
    for channel in $channels; do
        file=$here/channels/$channel.yml
        if [ ! -f "$file" ]; then
            echo "render-config.sh: DUALTRACK_CHANNELS: unknown channel '$channel' (known: slack pagerduty email msteams)" >&2
            exit 2
        fi
        printf '/# dualtrack:channels$/r %s\n' "$file"
    done
    if [ -n "$channels" ] && [ -z "${DUALTRACK_WEBHOOK_URL:-}" ] && [ -z "${DUALTRACK_CRITICAL_WEBHOOK_URL:-}" ]; then
        printf '/^    webhook_configs:$/,/^        send_resolved: true$/d\n'
    fi
} > "$script"

sed -f "$script" "$template" |
  sed -e "s|@SECRETS@|$(sed_escape "${DUALTRACK_ALERTMANAGER_SECRETS:-/etc/dualtrack/secrets/notify}")|g" \
    -e "s|@DUALTRACK_EMAIL_TO@|$(sed_escape "${DUALTRACK_EMAIL_TO:-}")|g" \
    -e "s|@DUALTRACK_EMAIL_FROM@|$(sed_escape "${DUALTRACK_EMAIL_FROM:-}")|g" \
    -e "s|@DUALTRACK_SMTP_SMARTHOST@|$(sed_escape "${DUALTRACK_SMTP_SMARTHOST:-}")|g" \
    -e "s|@DUALTRACK_SMTP_USERNAME@|$(sed_escape "${DUALTRACK_SMTP_USERNAME:-}")|g" \
    -e "s|@DUALTRACK_SMTP_REQUIRE_TLS@|$(sed_escape "${DUALTRACK_SMTP_REQUIRE_TLS:-true}")|g" \
    -e "s|@DUALTRACK_PAGERDUTY_URL@|$(sed_escape "${DUALTRACK_PAGERDUTY_URL:-https://events.pagerduty.com/v2/enqueue}")|g" \
    > "$output"
rm -f "$script"  # exec below skips the EXIT trap

if [ $# -gt 0 ]; then
    exec "$@"
fi
