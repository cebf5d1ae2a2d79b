USERS = {"ada": "x9"}


def find_user(name):
    return name if name in USERS else None


def check_password(user, password):
    return USERS[user] == password
