"""The Responses API: its protocol, output items and events, routes, service and store."""
