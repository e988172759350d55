#!/bin/sh
# The image's entrypoint. Serves the runtime bundle mounted at $COSYVOICE_MODEL_MOUNT (the image sets
# /models/bundle) unless COSYVOICE_MODEL_DIR names another; with neither, cosyvoice-serve serves its
# embedded demo bundle, so that the image runs without a mount. Arguments that start with "-" go to
# cosyvoice-serve; any other command (cosyvoice-run, sh, ...) runs in its place, with the same model.
# exec: the server becomes this process (PID 1 in the container), so that docker stop's SIGTERM reaches it
# and it shuts down gracefully instead of being killed after the grace period.
set -eu
if [ -z "${COSYVOICE_MODEL_DIR:-}" ] && [ -n "${COSYVOICE_MODEL_MOUNT:-}" ] && [ -e "$COSYVOICE_MODEL_MOUNT" ]; then
    export COSYVOICE_MODEL_DIR="$COSYVOICE_MODEL_MOUNT"
fi
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
    exec cosyvoice-serve "$@"
fi
exec "$@"
