"""What the API and the workers share: settings, database, tables, job operations, storage, dispatch, security,
migrations, input path rules and the reaper. Imports neither `api` nor `worker`."""
