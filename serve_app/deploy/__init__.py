"""Deploying the app: build_app (the Serve application from deploy.yaml's args), `make serve`'s
launcher, a local Ray cluster, the code bundle shipped to the nodes."""
