"""What operators do to a namespace: snapshot and health, dead letters, namespaces,
pause/resume and releasing a gone trainer. The CLI is a thin layer over these functions; they
are plain async functions over a redis client so scripts and dashboards can call them too."""
