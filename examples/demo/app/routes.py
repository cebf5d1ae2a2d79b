from app.auth import login


def post_login(form):
    return login(form["name"], form["password"])
